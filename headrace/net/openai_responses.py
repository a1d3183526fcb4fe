"""The OpenAI Responses API's wire format (``POST /v1/responses``), in terms of chat messages.

A request's ``input`` (a string, or items: messages, ``function_call``s, ``function_call_output``s)
becomes chat messages (an assistant's calls join its message, as the chat API writes them; a
call's output is a ``tool`` message), ``instructions`` a system message, function ``tools`` the
chat API's shape. The conversation of ``previous_response_id`` is kept by whoever answers (the
agents' endpoint keeps each episode's). The reply is a ``message`` item with its text and a
``function_call`` item per call; ``stream`` gives the same as buffered server-sent events.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from headrace.core.types import SamplingParams

from .openai_wire import ApiError, _int, _number, _text, _top_k, check_tools, tool_choice


@dataclass(frozen=True)
class ResponsesRequest:
    messages: list[dict[str, Any]]  # the new input, as chat messages
    params: SamplingParams
    instructions: str = ""
    previous_id: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # in the chat API's shape
    read_calls: bool = True
    stream: bool = False
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats


def parse_responses(body: dict[str, Any], defaults: SamplingParams) -> ResponsesRequest:
    for key, why in (("background", "a response is answered while the request waits"),
                     ("conversation", "conversations are kept per episode with previous_response_id")):  # fmt: skip
        if body.get(key):
            raise ApiError(400, f"'{key}' is not supported: {why}", key)
    text_format = ((body.get("text") or {}).get("format") or {}).get("type", "text")
    if text_format != "text":
        raise ApiError(400, f"text.format {text_format!r} is not supported: replies are free text", "text.format")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise ApiError(400, "'previous_response_id' must be a string", "previous_response_id")
    instructions = body.get("instructions") or ""
    if not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", "instructions")
    messages = _input(body.get("input"))
    params = SamplingParams(
        max_tokens=_int(body, "max_output_tokens", defaults.max_tokens, 1),
        temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0, open_low=True),
        top_k=_top_k(body, defaults.top_k),
    )
    tools = check_tools([_chat_tool(t, i) for i, t in enumerate(body.get("tools") or [])])
    echo = {k: body.get(k) for k in ("tools", "tool_choice", "temperature", "top_p", "max_output_tokens", "metadata")}
    return ResponsesRequest(
        messages, params, instructions, previous, tools, tool_choice(body.get("tool_choice")),
        bool(body.get("stream", False)), echo,
    )  # fmt: skip


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ApiError(400, f"tools[{i}] is a {kind!r} tool; only function tools are supported", f"tools[{i}]")
    spec = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": spec}


def _input(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'input' must be a string or a non-empty list of input items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer", f"{where}.role")
            out.append({"role": role, "content": _text(_parts(item.get("content")), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{where}: a function_call needs a name and a call_id", where)
            arguments = item.get("arguments", "{}")
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}  # fmt: skip
            if out and out[-1]["role"] == "assistant":  # the calls of one reply join its message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = output if isinstance(output, str) else _text(_parts(output), where)
            out.append({"role": "tool", "content": content, "tool_call_id": str(item.get("call_id", ""))})
        elif kind == "reasoning":
            continue  # another model's reasoning, shown to no one here
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported", where)
    return out


def _parts(content: Any) -> Any:
    """Responses content parts (``input_text``, ``output_text``) as the chat API's ``text`` parts."""
    if isinstance(content, list):
        return [
            {**p, "type": "text"} if isinstance(p, dict) and p.get("type") in ("input_text", "output_text") else p
            for p in content
        ]
    return content


def response_body(
    rid: str,
    model: str,
    version: int,
    content: str,
    tool_calls: list[dict[str, Any]],
    finish: str,
    input_tokens: int,
    output_tokens: int,
    request: ResponsesRequest,
) -> dict[str, Any]:
    incomplete = finish == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[dict[str, Any]] = []
    if content or not tool_calls:
        text = {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                       "content": [text]})  # fmt: skip
    for call in tool_calls:
        fn = call["function"]
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                       "name": fn["name"], "arguments": fn["arguments"], "status": "completed"})  # fmt: skip
    echo = request.echo
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions or None,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": request.previous_id,
        "tool_choice": echo.get("tool_choice") or "auto",
        "tools": echo.get("tools") or [],
        "temperature": echo.get("temperature"),
        "top_p": echo.get("top_p"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "metadata": echo.get("metadata") or {},
        "text": {"format": {"type": "text"}},
        "policy_version": version,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


def response_events(body: dict[str, Any]) -> bytes:
    """A finished response as the Responses API streams one: created, each output item (its text
    or its arguments as one delta), completed."""
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**body, "status": "in_progress", "output": [], "usage": None}}
    ]
    for index, item in enumerate(body["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", **where, "content_index": 0, "part": {**part, "text": ""}},
                {"type": "response.output_text.delta", **where, "content_index": 0, "delta": part["text"],
                 "logprobs": []},
                {"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                 "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]  # fmt: skip
        else:
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"],
                 "name": item["name"]},
            ]  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": body})
    return b"".join(
        f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': n})}\n\n".encode()
        for n, e in enumerate(events)
    )
