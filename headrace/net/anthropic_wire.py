"""The Anthropic Messages API's wire format (``POST /v1/messages``), in terms of chat messages.

A request's ``system`` (a string or text blocks) becomes a system message, its ``messages``
(``user`` and ``assistant`` turns, each a string or text content blocks) chat messages, and a
final ``assistant`` turn the prefill the answer continues, as Anthropic's API treats it.
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p`` and ``top_k`` are the sampling
parameters; ``metadata.scenario`` (or the ``x-headrace-scenario`` header) the scenario, and
``chat_template_kwargs`` go to the chat template, as on the chat API. So a request here is a
``ChatRequest``, served, captured and trained exactly as a chat completion is.

The reply is a ``message`` with one ``text`` block, ``stop_reason`` ``end_turn``, ``max_tokens``
or ``stop_sequence`` (with the ``stop_sequence`` that ended it), and the serving version in
``policy_version``; ``stream`` gives Anthropic's server-sent events (``message_start``,
``content_block_start``, ``content_block_delta``, ``content_block_stop``, ``message_delta``,
``message_stop``), buffered: the whole answer is sampled before the first event. Refusals use
Anthropic's error body (``{"type": "error", "error": {"type", "message"}}``), so its client raises
its own ``BadRequestError`` (and friends) with the message. Tools, images and extended thinking
are refused with a 400 that says so.
"""

from __future__ import annotations

import json
from typing import Any

from headrace.core.types import SamplingParams

from .openai_wire import (
    SCENARIO_HEADER,
    Answer,
    ApiError,
    ChatRequest,
    _int,
    _metadata_scenario,
    _number,
    _shown,
    template_kwargs,
)

MAX_STOP_SEQUENCES = 16
# ApiError kinds that Anthropic names otherwise; the rest (invalid_request_error, authentication_error,
# not_found_error) are the same words
ERROR_TYPES = {"conflict_error": "invalid_request_error", "server_error": "api_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(error.kind, error.kind)
    if error.status == 413:
        kind = "request_too_large"
    return {"type": "error", "error": {"type": kind, "message": str(error)}}


def parse_messages(
    body: dict[str, Any], headers: dict[str, str], defaults: SamplingParams, model: str | None
) -> ChatRequest:
    """The request as a ``ChatRequest``, or the ``ApiError`` that names what is wrong."""
    if model is not None and body.get("model") not in (None, model):
        raise ApiError(404, f"the model '{body['model']}' is not served here; this server serves '{model}'", "model")
    for key, why in (
        ("tools", "tools are served on /v1/chat/completions (OpenAI's form); this endpoint answers in text"),
        ("tool_choice", "tools are served on /v1/chat/completions (OpenAI's form)"),
        ("mcp_servers", "this server calls no MCP servers"),
        ("container", "this server runs no code containers"),
    ):
        if body.get(key):
            raise ApiError(400, f"'{key}' is not supported: {why}", key)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise ApiError(
            400,
            "extended 'thinking' is not supported: the model's own reasoning, if its template has one, is "
            'switched by chat_template_kwargs (e.g. {"enable_thinking": true})',
            "thinking",
        )
    messages = [_message(m, i) for i, m in enumerate(_list(body.get("messages")))]
    system = _system(body.get("system"))
    if system:
        messages.insert(0, {"role": "system", "content": system})
    prefill = ""
    if messages[-1]["role"] == "assistant":
        prefill = messages.pop()["content"]
    if not any(m["role"] == "user" for m in messages):
        raise ApiError(400, "'messages' needs a user turn before the answer", "messages")
    params = SamplingParams(
        max_tokens=_int(body, "max_tokens", defaults.max_tokens, 1),
        # Anthropic's range is 0 to 1; the samplers take up to 2, as OpenAI's
        temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0, open_low=True),
        top_k=_int(body, "top_k", defaults.top_k, 1, 2**31 - 1),
    )
    scenario = headers.get(SCENARIO_HEADER) or _metadata_scenario(body.get("metadata"))
    return ChatRequest(
        messages, prefill, params, _stop_sequences(body.get("stop_sequences")), bool(body.get("stream", False)),
        scenario, template_kwargs=template_kwargs(body.get("chat_template_kwargs")),
    )  # fmt: skip


def _list(raw: Any) -> list[Any]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    return raw


def _message(m: Any, i: int) -> dict[str, str]:
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        role = m.get("role") if isinstance(m, dict) else None
        raise ApiError(
            400,
            f"{where}: role {role!r} is not one of 'user', 'assistant' (the system prompt is the top-level 'system')",
            where,
        )
    return {"role": m["role"], "content": _blocks(m.get("content"), f"{where}.content")}


def _system(raw: Any) -> str:
    if raw is None or isinstance(raw, str):
        return raw or ""
    return _blocks(raw, "system")


def _blocks(content: Any, where: str) -> str:
    """A string, or text content blocks joined; any other block is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text blocks", where)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif kind in ("image", "document"):
            raise ApiError(400, f"{where}.{j}: {kind} blocks are not supported; this model reads text only", where)
        elif kind in ("tool_use", "tool_result"):
            raise ApiError(
                400, f"{where}.{j}: {kind} blocks are not supported here; tools are served on /v1/chat/completions",
                where,
            )  # fmt: skip
        else:
            raise ApiError(400, f"{where}.{j}: content block of type {kind!r} is not supported (text only)", where)
    return "".join(parts)


def _stop_sequences(raw: Any) -> tuple[str, ...]:
    stops = raw if raw is not None else []
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > MAX_STOP_SEQUENCES
    ):
        raise ApiError(
            400,
            f"'stop_sequences' must be a list of at most {MAX_STOP_SEQUENCES} non-empty strings, got {_shown(raw)}",
            "stop_sequences",
        )
    return tuple(stops)


def message_body(mid: str, model: str, version: int, ans: Answer, prompt_tokens: int) -> dict[str, Any]:
    if ans.stop_hit is not None:
        reason = "stop_sequence"
    else:
        reason = "end_turn" if ans.finish_reason == "stop" else "max_tokens"
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": ans.text}],
        "stop_reason": reason,
        "stop_sequence": ans.stop_hit,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": len(ans.tokens)},
        "policy_version": version,
    }


def message_events(body: dict[str, Any]) -> bytes:
    """A finished message as Anthropic's server-sent events, in the order its clients expect."""
    start = {**body, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**body["usage"], "output_tokens": 0}
    text = body["content"][0]["text"]
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": start}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),  # fmt: skip
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        ),  # fmt: skip
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
                "usage": {"output_tokens": body["usage"]["output_tokens"]},
            },
        ),  # fmt: skip
        ("message_stop", {"type": "message_stop"}),
    ]
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)
