"""Tool calls through the renderers, checked against transformers' own template output: a
template that speaks Hermes tools (Qwen2.5's) is given the tools and renders the calls itself; one
that knows no tools (SmolLM2's) gets the same text from the renderer; the calls a template
writes parse back into the same calls; the tiny format round-trips in its own alphabet."""

from __future__ import annotations

import json

import pytest

from headrace.renderers import renderer_for
from headrace.renderers.tools import HERMES, arguments_of, lower_tools
from headrace.tokenizers.char import CharTokenizer
from tests.test_renderers import CHATML, byte_tokenizer

# Qwen2.5-Instruct's chat template (tokenizer_config.json), the reference Hermes tool format
QWEN25 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
LOOKUP = {"type": "function", "function": {"name": "look_up", "description": "Find a word.", "parameters": {}}}
TOOLS = [ADD, LOOKUP]


def call(name: str, arguments: dict, cid: str = "call_1") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# a conversation with a system message, a reply with text and two calls, their two results, a last reply
CONVERSATION = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 2+3, and what does 'ten' mean?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [call("add", {"a": 2, "b": 3}),
                                                                       call("look_up", {"word": "ten"}, "call_2")]},
    {"role": "tool", "content": "5", "tool_call_id": "call_1"},
    {"role": "tool", "content": "the number 10", "tool_call_id": "call_2"},
    {"role": "assistant", "content": "2+3 = 5."},
    {"role": "user", "content": "And 4+4?"},
]  # fmt: skip


def qwen():
    return byte_tokenizer(QWEN25, eos_token="<|im_end|>", bos_token="<|im_start|>")


def chatml():
    return byte_tokenizer(CHATML, eos_token="<|im_end|>", bos_token="<|im_start|>")


def as_template_sees_it(messages):
    """What a caller hands transformers: each call's arguments as an object."""

    def objects(calls):
        return [
            {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in calls
        ]

    return [{**m, "tool_calls": objects(m["tool_calls"])} if m.get("tool_calls") else m for m in messages]


def test_a_template_that_speaks_hermes_is_given_the_tools_and_renders_as_transformers_does():
    tok = qwen()
    r = renderer_for("some-qwen", tok)
    assert r.name == "chat_template" and r.native_tools
    prompt = r.prompt_with_tools(CONVERSATION, TOOLS)
    expected = tok.hf.apply_chat_template(
        as_template_sees_it(CONVERSATION), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert tok.hf.decode(prompt, skip_special_tokens=False) == expected
    assert "<tool_call>\n" in expected and "<tool_response>\n5\n</tool_response>" in expected  # the template's own


def test_a_template_without_tools_gets_the_hermes_text_the_tool_template_would_have_written():
    # ChatML with no tool support (SmolLM2's shape) + the renderer's Hermes text == Qwen2.5's own output
    plain, reference = chatml(), qwen()
    r = renderer_for("some-chatml", plain)
    assert not r.native_tools
    ours = plain.hf.decode(r.prompt_with_tools(CONVERSATION, TOOLS), skip_special_tokens=False)
    theirs = reference.hf.apply_chat_template(
        as_template_sees_it(CONVERSATION), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs


@pytest.mark.parametrize("make", [qwen, chatml])
def test_calls_a_template_writes_parse_back_into_the_same_calls(make):
    tok = make()
    r = renderer_for("m", tok)
    reference = qwen().hf
    said = CONVERSATION[2]
    # the assistant turn as the Hermes template writes it, sampled back as its tokens + <|im_end|>
    closed = reference.apply_chat_template(as_template_sees_it(CONVERSATION[:3]), tools=TOOLS, tokenize=False)
    text = closed[closed.rindex("<|im_start|>assistant") + len("<|im_start|>assistant") :].lstrip("\n")
    reply = r.parse_reply(r.parse_response(tok.encode(text))[0]["content"], TOOLS)
    assert not reply.invalid and reply.content == said["content"]
    assert [(c["function"]["name"], arguments_of(c)) for c in reply.tool_calls] == [
        (c["function"]["name"], arguments_of(c)) for c in said["tool_calls"]
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in reply.tool_calls)
    # and written back, the calls render as the sampled text did: the next prompt extends it
    assert HERMES.write_calls(reply.content, reply.tool_calls) == text.removesuffix("<|im_end|>\n")


@pytest.mark.parametrize("make", [qwen, chatml])
def test_a_continuation_with_tool_results_extends_the_prompt_and_matches_the_whole_render(make):
    tok = make()
    r = renderer_for("m", tok)
    first = r.prompt_with_tools(CONVERSATION[:2], TOOLS)
    action = tok.encode(HERMES.write_calls("Let me check.", CONVERSATION[2]["tool_calls"])) + list(r.end_of_turn)
    after = r.continuation_with_tools(CONVERSATION[3:5], TOOLS)
    whole = r.prompt_with_tools(CONVERSATION[:5], TOOLS)
    assert first + action + after == whole  # token in / token out, and what a full render gives


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "subtract", "arguments": {}}\n</tool_call>',  # no such tool
        '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><tool_call>\n{"name":',  # the second broken
    ],
)
def test_a_malformed_call_comes_back_as_the_whole_text(text):
    reply = HERMES.parse(text, TOOLS)
    assert reply.invalid and reply.content == text and reply.tool_calls == []


def test_replies_without_calls_or_without_tools_are_text():
    assert HERMES.parse("5", TOOLS) == HERMES.parse("5", []) and not HERMES.parse("5", TOOLS).invalid
    raw = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert HERMES.parse(raw, []).content == raw  # no tools offered: nothing is a call
    unclosed = HERMES.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', TOOLS)
    assert not unclosed.invalid and arguments_of(unclosed.tool_calls[0]) == {"a": 1, "b": 2}


def test_the_tiny_format_round_trips_in_the_character_alphabet():
    tok = CharTokenizer()
    r = renderer_for("tiny", tok)
    prompt = tok.decode(r.prompt_with_tools(CONVERSATION[1:], TOOLS))
    assert "tools: add(a,b) add two integers.; lookup() find a word." in prompt  # no '_' in the alphabet
    assert "a:let me check.<call>add(a=2,b=3)</call><call>lookup(word=ten)</call>t:5t:the number 10" in prompt
    sampled = tok.encode("ok<call>look_up(word=ten)</call><call>add(a=2, b=3)</call>") + [tok.eos_token_id]
    reply = r.parse_reply(r.parse_response(sampled)[0]["content"], TOOLS)
    assert not reply.invalid and reply.content == "ok"
    assert [(c["function"]["name"], arguments_of(c)) for c in reply.tool_calls] == [
        ("look_up", {"word": "ten"}),
        ("add", {"a": 2, "b": 3}),
    ]
    for bad in ("<call>divide(a=1)</call>", "<call>add a=1</call>", "<call>add(a)</call>"):
        assert r.parse_reply(bad, TOOLS).invalid


def test_without_tools_the_renderers_render_as_before():
    for tok, model in ((qwen(), "m"), (chatml(), "m"), (CharTokenizer(), "tiny")):
        r = renderer_for(model, tok)
        plain = [{"role": "user", "content": "hi"}]
        assert r.prompt_with_tools(plain, None) == r.build_generation_prompt(plain)
        assert r.continuation_with_tools(plain, []) == r.continuation(plain)


def test_lowering_merges_a_run_of_results_and_keeps_a_system_message_first():
    lowered = lower_tools(CONVERSATION, TOOLS, HERMES)
    assert [m["role"] for m in lowered] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert lowered[0]["content"].startswith("You are a careful calculator.\n\n# Tools")
    assert (
        lowered[3]["content"]
        == "<tool_response>\n5\n</tool_response>\n<tool_response>\nthe number 10\n</tool_response>"
    )


# ---- SmolLM2-135M's own tokenizer and template ----


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_renders_tools_as_the_hermes_template_and_parses_them_back():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from headrace.models import ModelLoadError, model_dir
    from headrace.tokenizers.hf import HFTokenizer

    try:
        tok = HFTokenizer(AutoTokenizer.from_pretrained(model_dir("smollm2-135m")))
    except ModelLoadError as e:
        pytest.skip(str(e))
    r = renderer_for("smollm2-135m", tok)
    assert not r.native_tools  # SmolLM2's template knows no tools: the renderer writes them
    prompt = r.prompt_with_tools(CONVERSATION, TOOLS)
    reference = qwen().hf.apply_chat_template(
        as_template_sees_it(CONVERSATION), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert tok.hf.decode(prompt, skip_special_tokens=False) == reference
    # parity without tools: the renderer's prompt is the template's own tokens
    plain = [m for m in CONVERSATION if m["role"] in ("system", "user")]
    assert r.prompt_with_tools(plain, None) == tok.apply_chat_template(plain)
    # a sampled call, as SmolLM2's tokens, parses back; the next prompt extends it token for token
    said = CONVERSATION[2]
    action = tok.encode(HERMES.write_calls(said["content"], said["tool_calls"])) + list(r.end_of_turn)
    reply = r.parse_reply(r.parse_response(action)[0]["content"], TOOLS)
    assert [c["function"]["name"] for c in reply.tool_calls] == ["add", "look_up"]
    first = r.prompt_with_tools(CONVERSATION[:2], TOOLS)
    assert first + action + r.continuation_with_tools(CONVERSATION[3:5], TOOLS) == r.prompt_with_tools(
        CONVERSATION[:5], TOOLS
    )
