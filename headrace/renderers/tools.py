"""Tool calls in text: how a format offers tools to the model, writes an assistant's calls and the
tools' results into the conversation, and reads the calls back out of a sampled reply.

A tool and a call are OpenAI's chat-completions shapes: ``{"type": "function", "function":
{"name", "description", "parameters"}}`` and ``{"id", "type": "function", "function": {"name",
"arguments"}}`` (``arguments`` a JSON text). Two formats:

- :data:`HERMES`, the Hermes/Qwen2.5 format (``<tool_call>{"name": ..., "arguments": ...}
  </tool_call>``, results in ``<tool_response>`` blocks of a user turn), written exactly as
  Qwen2.5's chat template writes it. A chat template that speaks it gets the tools itself
  (``apply_chat_template(tools=...)``); one that knows no tools (SmolLM2's) gets the same text
  from :func:`lower_tools`, so the model sees what the Hermes template would have shown it.
- :class:`CompactFormat`, for the embedded tiny model's 56-symbol alphabet (no braces, no
  quotes): ``<call>name(key=value,key=value)</call>``, results as ``tool`` turns.

A reply that opens a call but does not complete a valid one (bad JSON, an unknown tool, arguments
that are not an object) is ``invalid``: it is returned as text, as OpenAI's own parsers do.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Tool = dict[str, Any]
ToolCall = dict[str, Any]


@dataclass(frozen=True)
class Reply:
    """A sampled reply read as an assistant message: its text and its tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid: bool = False  # it tried to call a tool and failed: ``content`` is the whole text


def tool_name(tool: Tool) -> str:
    return str((tool.get("function") or tool).get("name", ""))


def call_of(name: str, arguments: dict[str, Any]) -> ToolCall:
    """A call as OpenAI returns it, with a fresh id."""
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def arguments_of(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as an object (its JSON text parsed; ``{}`` when it does not parse)."""
    raw = call.get("function", {}).get("arguments", {})
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return {}
    return raw if isinstance(raw, dict) else {}


class ToolFormat(ABC):
    """How one prompt format writes tools, calls and results as text, and reads calls back."""

    @abstractmethod
    def describe(self, tools: Sequence[Tool]) -> str:
        """The text that offers ``tools`` to the model (the system message's, or all of it)."""

    @abstractmethod
    def write_calls(self, content: str, calls: Sequence[ToolCall]) -> str:
        """An assistant turn's text: its content, then its calls."""

    @abstractmethod
    def results(self, contents: Sequence[str]) -> list[dict[str, str]]:
        """The messages that carry a run of consecutive tool results."""

    @abstractmethod
    def parse(self, text: str, tools: Sequence[Tool]) -> Reply:
        """The calls in a sampled reply; none are read when no tools were offered."""


class HermesFormat(ToolFormat):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)  # a last call left unclosed still counts

    def describe(self, tools: Sequence[Tool]) -> str:
        signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>"
        )

    def write_calls(self, content: str, calls: Sequence[ToolCall]) -> str:
        blocks = [
            f'{self.OPEN}\n{{"name": "{call["function"]["name"]}", "arguments": '
            f"{json.dumps(arguments_of(call), ensure_ascii=False)}}}\n{self.CLOSE}"
            for call in calls
        ]
        return "\n".join([content, *blocks] if content else blocks)

    def results(self, contents: Sequence[str]) -> list[dict[str, str]]:
        text = "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in contents)
        return [{"role": "user", "content": text}]

    def parse(self, text: str, tools: Sequence[Tool]) -> Reply:
        if not tools or self.OPEN not in text:
            return Reply(text)
        names = {tool_name(t) for t in tools}
        calls = []
        for block in self._BLOCK.finditer(text):
            try:
                payload = json.loads(block.group(1))
            except ValueError:
                return Reply(text, invalid=True)
            if not isinstance(payload, dict):
                return Reply(text, invalid=True)
            arguments = payload.get("arguments", payload.get("parameters", {}))
            if isinstance(arguments, str):  # some models write the arguments as a JSON text
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return Reply(text, invalid=True)
            if payload.get("name") not in names or not isinstance(arguments, dict):
                return Reply(text, invalid=True)
            calls.append(call_of(payload["name"], arguments))
        return Reply(self._BLOCK.sub("", text).strip(), calls)


class CompactFormat(ToolFormat):
    """``<call>name(key=value,...)</call>`` for an alphabet without braces or quotes. Names are
    compared as the format's tokenizer writes them (the tiny tokenizer drops ``_``), values read
    as JSON where they parse (numbers, true, false), else as text."""

    _CALL = re.compile(r"<call>(.*?)(?:</call>|$)", re.DOTALL)
    _FORM = re.compile(r"\s*([^\s(]+)\s*\((.*)\)\s*", re.DOTALL)

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer  # (picklable, as a renderer must be: group builders travel)

    def normalize(self, name: str) -> str:
        return self.tokenizer.decode(self.tokenizer.encode(name))

    def describe(self, tools: Sequence[Tool]) -> str:
        def one(tool: Tool) -> str:
            spec = tool.get("function") or tool
            params = ",".join((spec.get("parameters") or {}).get("properties", {}))
            return f"{spec.get('name', '')}({params}) {spec.get('description', '')}".strip()

        return "tools: " + "; ".join(map(one, tools)) + ". to call one write <call>name(key=value)</call>"

    def write_calls(self, content: str, calls: Sequence[ToolCall]) -> str:
        def value(v: Any) -> str:
            return v if isinstance(v, str) else json.dumps(v)

        def one(call: ToolCall) -> str:
            args = ",".join(f"{k}={value(v)}" for k, v in arguments_of(call).items())
            return f"<call>{call['function']['name']}({args})</call>"

        return content + "".join(map(one, calls))

    def results(self, contents: Sequence[str]) -> list[dict[str, str]]:
        return [{"role": "tool", "content": c} for c in contents]

    def parse(self, text: str, tools: Sequence[Tool]) -> Reply:
        if not tools or "<call>" not in text:
            return Reply(text)
        names = {self.normalize(tool_name(t)): tool_name(t) for t in tools}
        calls = []
        for block in self._CALL.finditer(text):
            form = self._FORM.fullmatch(block.group(1))
            name = names.get(form.group(1)) if form else None
            if form is None or name is None:
                return Reply(text, invalid=True)
            arguments: dict[str, Any] = {}
            for pair in filter(None, (p.strip() for p in form.group(2).split(","))):
                key, eq, raw = pair.partition("=")
                if not eq or not key.strip():
                    return Reply(text, invalid=True)
                arguments[key.strip()] = _scalar(raw.strip())
            calls.append(call_of(name, arguments))
        return Reply(self._CALL.sub("", text).strip(), calls)


def _scalar(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


HERMES = HermesFormat()


def lower_tools(messages: Sequence[Any], tools: Sequence[Tool] | None, fmt: ToolFormat) -> list[dict[str, str]]:
    """The conversation as plain ``{role, content}`` messages: the tools offered in the system
    message (``tools``; None in a continuation, which never repeats them), each assistant's calls
    written into its text, each run of tool results as the format's result messages."""
    out: list[dict[str, str]] = []
    rest = list(messages)
    if tools:
        text = fmt.describe(tools)
        if rest and rest[0]["role"] == "system":
            text = f"{rest.pop(0)['content']}\n\n{text}"
        out.append({"role": "system", "content": text})
    pending: list[str] = []
    for m in rest:
        if m["role"] == "tool":
            pending.append(m["content"])
            continue
        if pending:
            out += fmt.results(pending)
            pending = []
        content = m["content"]
        if m["role"] == "assistant" and m.get("tool_calls"):
            content = fmt.write_calls(content, m["tool_calls"])
        out.append({"role": m["role"], "content": content})
    if pending:
        out += fmt.results(pending)
    return out


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages for a chat template that takes tools itself: each call's arguments as an object,
    which templates write with ``tojson`` (a JSON text would be written as a quoted string)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": arguments_of(c)}} for c in m["tool_calls"]
            ]
        out.append(m)
    return out
