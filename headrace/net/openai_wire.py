"""The OpenAI chat-completions wire format: a request body checked into what the sampler needs,
and a sampled completion back into a response (or buffered server-sent events). ``headrace
serve`` and the agents' endpoint (``headrace/agents``) both speak it.

Tools: ``tools`` (function tools), ``tool_choice`` ``auto`` or ``none`` (the model decides; with
``none`` its calls are not read), assistant messages with ``tool_calls`` and ``tool`` results are
taken; a reply's calls come back as ``tool_calls`` with ``finish_reason: "tool_calls"``. Writing
and reading the calls as text is the renderer's (``headrace/renderers/tools.py``).

Every refusal is an ``ApiError``: its status and an OpenAI-style body
(``{"error": {"message", "type", "param", "code"}}``), so an OpenAI client raises its own
``BadRequestError`` (and friends) with the message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from headrace.core.errors import RequestError
from headrace.core.types import SampledTokens, SamplingParams, StopReason

MAX_STOP_STRINGS = 4  # as OpenAI allows
INT64_MAX, INT32_MAX = 2**63 - 1, 2**31 - 1
SCENARIO_HEADER = "x-headrace-scenario"
VERSION_HEADER = "x-headrace-version"


class ApiError(RequestError):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.kind = kind or {401: "authentication_error", 404: "not_found_error", 409: "conflict_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # what the renderer renders (the prefill left out)
    prefill: str  # a final assistant message's content: the answer starts with it
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    scenario: str | None
    logprobs: bool = False
    tools: list[dict[str, Any]] = field(default_factory=list)  # offered to the model
    read_calls: bool = True  # False for tool_choice "none": the tools are shown, calls are not read
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, for the chat template


def parse_chat(
    body: dict[str, Any], headers: dict[str, str], defaults: SamplingParams, model: str | None
) -> ChatRequest:
    """The request's messages and sampling parameters, or the ``ApiError`` that names what is wrong.
    ``model``: the one name served (None: any name, the one policy behind the endpoint answers)."""
    if model is not None and body.get("model") not in (None, model):
        raise ApiError(
            404, f"the model '{body['model']}' is not served here; this server serves '{model}'", "model",
            "model_not_found",
        )  # fmt: skip
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise ApiError(400, f"'{key}' is OpenAI's retired form of tool calls: send 'tools' instead", key)
    tools = check_tools(body.get("tools"))
    read_calls = tool_choice(body.get("tool_choice"))
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, f"n = {_shown(n)}: one completion per request is served here; send n requests instead", "n")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise ApiError(400, f"'{key}' is not supported (it changes the distribution that trains)", key)
    messages = _messages(body.get("messages"))
    prefill = ""
    if messages and messages[-1]["role"] == "assistant":
        prefill = messages.pop()["content"]
    if not messages:
        raise ApiError(400, "'messages' needs at least one message before the answer", "messages")
    params = SamplingParams(
        max_tokens=_int(body, "max_completion_tokens", _int(body, "max_tokens", defaults.max_tokens, 1), 1),
        temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0, open_low=True),
        top_k=_top_k(body, defaults.top_k),
        seed=_int(body, "seed", None, None),
    )
    scenario = headers.get(SCENARIO_HEADER) or _metadata_scenario(body.get("metadata"))
    stream = bool(body.get("stream", False))
    return ChatRequest(
        messages, prefill, params, _stop(body.get("stop")), stream, scenario, _logprobs(body), tools, read_calls,
        template_kwargs(body.get("chat_template_kwargs")),
    )  # fmt: skip


def template_kwargs(raw: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` (vLLM's name): extra variables the chat template reads, such as
    ``enable_thinking``; JSON values keyed by identifiers."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and k.isidentifier() for k in raw):
        raise ApiError(
            400,
            "'chat_template_kwargs' must be an object of template variables, e.g. {\"enable_thinking\": false}",
            "chat_template_kwargs",
        )
    reserved = sorted(set(raw) & {"messages", "tools", "add_generation_prompt", "tokenize"})
    if reserved:
        raise ApiError(
            400, f"'chat_template_kwargs' may not set {', '.join(reserved)}: the request's own fields set them",
            "chat_template_kwargs",
        )  # fmt: skip
    return dict(raw)


def check_tools(raw: Any) -> list[dict[str, Any]]:
    """Function tools as OpenAI's chat API takes them: ``{"type": "function", "function": {"name", ...}}``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ApiError(400, "'tools' must be a list of {type: 'function', function: {name, parameters}}", "tools")
    for i, tool in enumerate(raw):
        spec = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(spec, dict):
            raise ApiError(
                400, f"tools[{i}] must be {{type: 'function', function: {{name, description, parameters}}}} "
                "(function tools only)", f"tools[{i}]",
            )  # fmt: skip
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ApiError(400, f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
    return raw


def tool_choice(raw: Any) -> bool:
    """Whether the reply's calls are read: ``auto`` (the default) yes, ``none`` no. Forcing a call
    would need constrained decoding, which the samplers do not do."""
    if raw in (None, "auto"):
        return True
    if raw == "none":
        return False
    raise ApiError(
        400,
        f"tool_choice {raw!r} is not supported: the model decides whether to call a tool; send 'auto' or 'none'",
        "tool_choice",
    )


def _logprobs(body: dict[str, Any]) -> bool:
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"'logprobs' must be true or false, got {wanted!r}", "logprobs")
    if _int(body, "top_logprobs", 0, 0):
        raise ApiError(
            400,
            "'top_logprobs' is not supported: the sampler keeps the logprob of the token it drew, not of the "
            "others; ask for 'logprobs': true without 'top_logprobs'",
            "top_logprobs",
        )
    return bool(wanted)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a 'role' string and a 'content'", where)
        if m["role"] == "function" or m.get("function_call"):
            raise ApiError(400, f"{where}: 'function' messages are OpenAI's retired form; use 'tool' messages", where)
        message: dict[str, Any] = {
            "role": "system" if m["role"] == "developer" else m["role"],
            "content": _text(m.get("content"), where),
        }
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _calls(m["tool_calls"], f"{where}.tool_calls")
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's calls, as OpenAI sends them back: ``{id, type, function: {name, arguments}}``."""
    if not isinstance(raw, list):
        raise ApiError(400, f"{where} must be a list of {{id, type: 'function', function: {{name, arguments}}}}", where)
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}[{j}] must have a function with a name and arguments", f"{where}[{j}]")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments},
            }
        )
    return calls


def _text(content: Any, where: str) -> str:
    if content is None:  # an assistant message with only tool calls
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind in ("image_url", "input_image", "image"):
                raise ApiError(400, f"{where}: images are not supported; this model reads text only", where)
            else:
                raise ApiError(400, f"{where}: content part of type {kind!r} is not supported (text only)", where)
        return "".join(parts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _int(body: dict[str, Any], key: str, default: Any, low: int | None, high: int = INT64_MAX) -> Any:
    """An integer option from ``low`` (None: -2**63) to ``high``: every sampler takes a 64-bit one."""
    value = body.get(key)
    if value is None:
        return default
    low_ = -INT64_MAX - 1 if low is None else low
    if isinstance(value, bool) or not isinstance(value, int) or not low_ <= value <= high:
        bounds = f"from {_bound(low_)} to {_bound(high)}"
        raise ApiError(400, f"'{key}' must be an integer {bounds}, got {_shown(value)}", key)
    return value


def _bound(n: int) -> str:
    return {INT64_MAX: "2**63 - 1", -INT64_MAX - 1: "-2**63", INT32_MAX: "2**31 - 1"}.get(n, str(n))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value <= high
    ok = ok and (value > low if open_low else value >= low)
    if not ok:
        bound = f"{'above' if open_low else 'at least'} {low:g} and at most {high:g}"
        raise ApiError(400, f"'{key}' must be a number {bound}, got {_shown(value)}", key)
    return float(value)


def _top_k(body: dict[str, Any], default: int) -> int:
    value = body.get("top_k")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or 1 <= value <= INT32_MAX):
        raise ApiError(400, f"'top_k' must be -1 (off) or an integer from 1 to 2**31 - 1, got {_shown(value)}", "top_k")
    return value


def _stop(raw: Any) -> tuple[str, ...]:
    stops = [raw] if isinstance(raw, str) else raw if raw is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise ApiError(
            400, f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop"
        )
    return tuple(stops)


def _metadata_scenario(metadata: Any) -> str | None:
    if isinstance(metadata, dict) and isinstance(metadata.get("scenario"), str):
        return metadata["scenario"]
    return None


@dataclass(frozen=True)
class Answer:
    """A sample as the client sees it, cut at a stop string; ``tokens``/``logprobs`` are what trains."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_hit: str | None = None  # the stop string the answer was cut before, if one was


def answer(sample: SampledTokens, renderer: Any, stop: Sequence[str], prefill: str = "") -> Answer:
    """The answer's text (``prefill`` is already in the prompt, so it is not repeated), cut before
    the first stop string; its tokens end with the one that completed that string."""
    text = renderer.parse_response(sample.tokens)[0]["content"]
    tokens, logprobs = list(sample.tokens), list(sample.logprobs)
    finish = "stop" if sample.stop_reason in (StopReason.STOP, StopReason.DONE) else "length"
    hits = sorted((text.find(s), i) for i, s in enumerate(stop) if s in text)
    hit = None
    if hits:
        cut, hit = hits[0][0], stop[hits[0][1]]
        # the shortest token prefix whose text holds a stop string: the token that completed it ends the answer
        for k in range(1, len(tokens) + 1):
            if any(s in renderer.parse_response(tokens[:k])[0]["content"] for s in stop):
                tokens, logprobs = tokens[:k], logprobs[:k]
                break
        text, finish = text[:cut], "stop"
    return Answer(text, tokens, logprobs, finish, hit)


def token_logprobs(ans: Answer, decode: Callable[[list[int]], str], stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """OpenAI's ``choices[].logprobs``: the sampler's logprob of each answer token that trains (the
    end-of-turn token left out, as OpenAI leaves it out); no alternatives (``top_logprobs``)."""
    content = []
    for token, logprob in zip(ans.tokens, ans.logprobs, strict=True):
        if token in stop_token_ids:
            continue
        text = decode([token])
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


def completion_body(
    cid: str,
    model: str,
    version: int,
    ans: Answer,
    prompt_tokens: int,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    content: str | None = None,
) -> dict[str, Any]:
    """``tool_calls``: the reply's calls, and ``content`` its text without them (read by the renderer)."""
    message: dict[str, Any] = {"role": "assistant", "content": ans.text if content is None else content}
    finish = ans.finish_reason
    if tool_calls:
        message = {"role": "assistant", "content": message["content"] or None, "tool_calls": tool_calls}
        finish = "tool_calls"
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "policy_version": version,
        "system_fingerprint": f"headrace-v{version}",
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ans.tokens),
            "total_tokens": prompt_tokens + len(ans.tokens),
        },
    }


def stream_body(body: dict[str, Any]) -> bytes:
    """A finished completion as server-sent events: role, content, finish, then ``[DONE]``."""
    base = {k: body[k] for k in ("id", "created", "model", "policy_version", "system_fingerprint")}
    choice = body["choices"][0]
    message = choice["message"]
    deltas: list[tuple[dict[str, Any], Any, Any]] = [
        ({"role": "assistant", "content": ""}, None, None),
        ({"content": message["content"] or ""}, None, choice["logprobs"]),
    ]
    if message.get("tool_calls"):
        calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        deltas.append(({"tool_calls": calls}, None, None))
    deltas.append(({}, choice["finish_reason"], None))
    events = [
        {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": d, "logprobs": lp, "finish_reason": f}],
        }
        for d, f, lp in deltas
    ]
    events[-1]["usage"] = body["usage"]
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
