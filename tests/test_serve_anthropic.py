"""`headrace serve`'s Anthropic Messages API (``POST /v1/messages``) through the real `anthropic`
client: plain and streamed, the token in ``x-api-key``, Anthropic's error bodies, captured and
trained exactly as a chat completion; and ``chat_template_kwargs`` reaching the chat template on
both APIs (fast, with a template that reads ``enable_thinking``)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from headrace.core.types import SampledTokens, SamplingParams, StopReason
from headrace.net.anthropic_wire import message_body, message_events, parse_messages
from headrace.net.openai_wire import ApiError, answer, parse_chat
from headrace.renderers import get_renderer, renderer_for
from headrace.tokenizers.char import CharTokenizer
from tests.serve_support import TOKEN, serving
from tests.test_renderers import byte_tokenizer

# present, not imported: importing the SDK takes ~4 s, which every pytest process paid at
# collection; the one test that drives it imports it
if importlib.util.find_spec("anthropic") is None:
    pytest.skip("the anthropic SDK is not installed (pip install anthropic)", allow_module_level=True)

DEFAULTS = SamplingParams(max_tokens=8)
THINKING = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n' }}{% endif %}{% endif %}"
)


def test_a_messages_request_is_a_chat_request():
    chat = parse_messages(
        {
            "model": "tiny", "max_tokens": 5, "system": [{"type": "text", "text": "be brief"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "two "},
                                                      {"type": "text", "text": "parts"}]},
                         {"role": "assistant", "content": "so"}],
            "stop_sequences": ["x", "yz"], "temperature": 0.5, "top_p": 0.9, "top_k": 4, "stream": True,
            "metadata": {"scenario": "meta"}, "chat_template_kwargs": {"enable_thinking": False},
        },
        {}, DEFAULTS, "tiny",
    )  # fmt: skip
    assert chat.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two parts"}]
    assert (chat.prefill, chat.stop, chat.stream, chat.scenario) == ("so", ("x", "yz"), True, "meta")
    assert chat.params == SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=4)
    assert chat.template_kwargs == {"enable_thinking": False}
    bad = {
        "messages": [{"role": "system", "content": "x"}],
        "tools": [{"name": "f", "input_schema": {}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "stop_sequences": "x",
        "chat_template_kwargs": {"messages": []},
    }
    for key, value in bad.items():
        body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], key: value}
        with pytest.raises(ApiError) as caught:
            parse_messages(body, {}, DEFAULTS, "tiny")
        assert caught.value.status == 400 and key in str(caught.value) + str(caught.value.param), key
    image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]
    with pytest.raises(ApiError, match="text only"):
        parse_messages({"messages": [{"role": "user", "content": image}]}, {}, DEFAULTS, None)


def test_stop_reasons_and_the_stream_events():
    tok = CharTokenizer()
    renderer = renderer_for("tiny", tok)
    tokens = tok.encode("hello world") + [tok.eos_token_id]
    sample = SampledTokens(tokens, [-0.5] * len(tokens), StopReason.STOP)
    reasons = {
        "end_turn": answer(sample, renderer, ()),
        "stop_sequence": answer(sample, renderer, ("zz", "o w", "ld")),
        "max_tokens": answer(SampledTokens(tokens[:4], [-0.5] * 4, StopReason.LENGTH), renderer, ()),
    }
    for reason, ans in reasons.items():
        body = message_body("msg_1", "tiny", 3, ans, 7)
        assert body["stop_reason"] == reason and body["policy_version"] == 3
    assert body["usage"] == {"input_tokens": 7, "output_tokens": 4}
    cut = message_body("msg_1", "tiny", 3, reasons["stop_sequence"], 7)
    assert (cut["stop_sequence"], cut["content"][0]["text"]) == ("o w", "hell")
    events = [block.split("\n") for block in message_events(cut).decode().strip().split("\n\n")]
    names = [e[0].removeprefix("event: ") for e in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    data = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert [d["type"] for d in data] == names and data[2]["delta"] == {"type": "text_delta", "text": "hell"}
    assert data[4]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "o w"}


def test_chat_template_kwargs_reach_the_template_on_both_apis():
    pytest.importorskip("transformers")
    renderer = get_renderer("chat_template", byte_tokenizer(THINKING, eos_token="<|im_end|>"))
    user = [{"role": "user", "content": "hi"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for parsed in (
        parse_chat({"messages": user, **off}, {}, DEFAULTS, None),
        parse_messages({"messages": user, "max_tokens": 4, **off}, {}, DEFAULTS, None),
    ):
        prompt = renderer.with_template_kwargs(parsed.template_kwargs).build_generation_prompt(parsed.messages)
        assert renderer.hf.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    plain = renderer.hf.decode(renderer.build_generation_prompt(user))  # the renderer itself is unchanged
    assert plain.endswith("<|im_start|>assistant\n") and "<think>" not in plain
    with pytest.raises(ValueError, match="no template"):
        renderer_for("tiny", CharTokenizer()).with_template_kwargs({"enable_thinking": False})


@pytest.mark.slow
def test_the_anthropic_client_plain_and_streamed_captured_and_trained_like_chat(tmp_path):
    anthropic = pytest.importorskip("anthropic")
    with serving(tmp_path / "d", "--batch-size", "3") as server:
        client = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=TOKEN, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # and openai's client reads the same list
        kwargs = dict(model="tiny", max_tokens=6, system="be brief", metadata={"scenario": "a"})  # type: ignore[typeddict-unknown-key]
        raw = client.messages.with_raw_response.create(messages=[{"role": "user", "content": "hi"}], **kwargs)
        message = raw.parse()
        assert raw.headers["x-headrace-version"] == "0" and message.model_extra["policy_version"] == 0
        assert message.id.startswith("msg_") and message.stop_reason in ("end_turn", "max_tokens")
        assert message.usage.output_tokens > 0 and message.content[0].type == "text"
        # the same conversation through the chat API is rendered to the same prompt
        chat, _ = server.chat("hi")  # no system prompt: compared below with one that has it
        server.client.chat.completions.create(
            model="tiny", max_tokens=6, messages=[{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "hi"}],
        )  # fmt: skip
        with client.messages.stream(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                    **kwargs) as stream:  # fmt: skip
            text = "".join(stream.text_stream)
            streamed = stream.get_final_message()
        assert streamed.content[0].text == text and streamed.model_extra["policy_version"] == 0
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=client.base_url, api_key="wrong", max_retries=0).messages.create(
                messages=[{"role": "user", "content": "hi"}], **kwargs
            )
        # this client version sends temperature, top_p and top_k only as extra fields
        greedy = {"temperature": 0, "top_p": 1.0, "top_k": 50}
        first = client.messages.create(messages=[{"role": "user", "content": "x"}], extra_body=greedy, **kwargs)
        text = first.content[0].text
        assert client.messages.create(messages=[{"role": "user", "content": "x"}], extra_body=greedy,
                                      **kwargs).content[0].text == text  # fmt: skip
        if len(text) >= 3:
            cut = client.messages.create(
                messages=[{"role": "user", "content": "x"}], stop_sequences=["\u2603", text[2]], extra_body=greedy,
                **kwargs,
            )  # fmt: skip
            assert (cut.content[0].text, cut.stop_reason, cut.stop_sequence) == (
                text[: text.index(text[2])],
                "stop_sequence",
                text[2],
            )
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(messages=[{"role": "user", "content": "hi"}], extra_body={"top_k": 0}, **kwargs)
        assert caught.value.body["error"]["type"] == "invalid_request_error" and "top_k" in str(caught.value)
        with pytest.raises(anthropic.BadRequestError, match="no template"):
            client.messages.create(
                messages=[{"role": "user", "content": "hi"}], extra_body={"chat_template_kwargs": {"x": 1}}, **kwargs
            )
        ids = [message.id, streamed.id, chat.id]
        assert server.post("/v1/feedback", [{"id": c, "reward": float(r)} for r, c in enumerate(ids)]).is_success
        line = server.wait_for_line(1)
        assert (line["outcome"], line["version"]) == ("published", 1) and set(line["completions"]) == set(ids)
        after = client.messages.with_raw_response.create(messages=[{"role": "user", "content": "again"}], **kwargs)
        assert after.headers["x-headrace-version"] == "1" and after.parse().model_extra["policy_version"] == 1
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "d" / "completions.jsonl").read_text().splitlines())}
    captured, system_chat = records[message.id], list(records.values())[2]
    assert captured["prompt_tokens"] == system_chat["prompt_tokens"] and captured["scenario"] == "a"
    assert len(captured["logprobs"]) == len(captured["completion_tokens"]) == message.usage.output_tokens
