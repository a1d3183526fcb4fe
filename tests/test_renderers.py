"""Renderers: messages <-> tokens for the embedded tokenizer, chat templates and base models, and
multi-turn observations that extend the previous prompt + sample token for token."""

from __future__ import annotations

import pytest

from headrace.core.errors import ConfigError
from headrace.renderers import default_renderer_name, get_renderer, renderer_for
from headrace.tokenizers.char import CharTokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Meta-Llama-3-8B-Instruct's template
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# shows only the last assistant turn in full, as templates that drop past reasoning do
REWRITING = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n...<|im_end|>\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
USER = {"role": "user", "content": "Guess a number from 0 to 9."}
TURNS = [("I guess 5.", "Higher."), ("7", "Lower!"), ("6 ", "Yes.")]  # a trailing space: no trimming of samples


def byte_tokenizer(template: str | None, **specials: str):
    """A byte-level tokenizer with no merges (every byte is a token, so any text round-trips),
    plus the given special tokens and chat template: builds in a second, downloads nothing."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    from headrace.tokenizers.hf import HFTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    extra = specials.pop("extra", "").split()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    hf.add_special_tokens({"additional_special_tokens": extra})
    if template:
        hf.chat_template = template
    return HFTokenizer(hf)


def chatml_tokenizer():
    return byte_tokenizer(CHATML, eos_token="<|im_end|>", bos_token="<|im_start|>")


def llama3_tokenizer():
    return byte_tokenizer(
        LLAMA3,
        eos_token="<|end_of_text|>",
        bos_token="<|begin_of_text|>",
        extra="<|start_header_id|> <|end_header_id|> <|eot_id|>",
    )


def play(renderer, encode, turns=TURNS, cut_off_at=None):
    """Run a conversation through the renderer as an env would: returns the observations, the
    actions and the messages of the whole conversation."""
    messages = [USER]
    obs = [renderer.build_generation_prompt(messages)]
    actions = []
    for i, (answer, feedback) in enumerate(turns):
        action = encode(answer) + ([] if i == cut_off_at else list(renderer.end_of_turn))
        reply = {"role": "user", "content": feedback}
        obs.append(renderer.next_observation(obs[-1], action, [reply]))
        actions.append(action)
        messages += [{"role": "assistant", "content": answer}, reply]
    return obs, actions, messages


def assert_extends(obs, actions):
    for prev, action, nxt in zip(obs, actions, obs[1:], strict=False):
        assert nxt[: len(prev) + len(action)] == prev + action  # nothing sampled is re-tokenised


# ---- the embedded tokenizer ----


def test_tiny_renders_turns_inside_the_character_vocabulary():
    tok = CharTokenizer()
    r = get_renderer("tiny", tok)
    prompt = r.build_generation_prompt([{"role": "system", "content": "be brief"}, USER])
    assert tok.unk_token_id not in prompt  # the format itself uses only characters the vocabulary has
    assert tok.decode(prompt) == "s:be briefu:guess a number from 0 to 9.a:"
    assert prompt.count(tok.eos_token_id) == 2 and r.stop_token_ids == (tok.eos_token_id,)
    assert r.parse_response(tok.encode("42") + [tok.eos_token_id]) == ({"role": "assistant", "content": "42"}, True)
    assert r.parse_response(tok.encode("42"))[1] is False  # cut off by max_tokens


def test_tiny_multi_turn_extends_the_previous_observation_exactly():
    tok = CharTokenizer()
    r = get_renderer("tiny", tok)
    obs, actions, messages = play(r, tok.encode, cut_off_at=1)
    assert_extends(obs, actions)
    # the cut-off action was closed with EOS, so the result is the whole conversation rendered afresh
    assert obs[-1] == r.build_generation_prompt(messages)


def test_renderer_names_and_defaults():
    tok = CharTokenizer()
    with pytest.raises(ConfigError, match="unknown renderer 'chat_templat'.*did you mean 'chat_template'"):
        get_renderer("chat_templat", tok)
    with pytest.raises(ConfigError, match="use --renderer tiny"):
        get_renderer("role_colon", tok)  # the character vocabulary has no newline
    with pytest.raises(ConfigError, match="has none.*--renderer role_colon"):
        get_renderer("chat_template", byte_tokenizer(None, eos_token="</s>"))
    assert default_renderer_name("tiny", tok) == "tiny"
    assert default_renderer_name("smollm2-135m", tok) == "chat_template"
    assert default_renderer_name("./some/dir", chatml_tokenizer()) == "chat_template"
    assert default_renderer_name("./some/dir", byte_tokenizer(None, eos_token="</s>")) == "role_colon"
    assert renderer_for("tiny", tok).name == "tiny" and renderer_for("tiny", tok, "tiny").name == "tiny"


# ---- chat templates ----


@pytest.mark.parametrize(
    ("make", "eot", "eos"),
    [(chatml_tokenizer, "<|im_end|>", "<|im_end|>"), (llama3_tokenizer, "<|eot_id|>", "<|end_of_text|>")],
)
def test_chat_template_stops_at_the_templates_end_of_turn_token(make, eot, eos):
    tok = make()
    r = get_renderer("chat_template", tok)
    eot_id, eos_id = tok.hf.convert_tokens_to_ids([eot, eos])
    assert r.end_of_turn == (eot_id,) and r.stop_token_ids == tuple(dict.fromkeys([eot_id, eos_id]))
    assert r.build_generation_prompt([USER]) == tok.apply_chat_template([USER], add_generation_prompt=True)
    reply = tok.encode("5") + [eot_id]
    assert r.parse_response(reply) == ({"role": "assistant", "content": "5"}, True)
    assert r.parse_response(tok.encode("5 and"))[1] is False


@pytest.mark.parametrize("make", [chatml_tokenizer, llama3_tokenizer])
@pytest.mark.parametrize("cut_off_at", [None, 0])
def test_chat_template_multi_turn_is_a_prefix_extension_that_decodes_to_the_template(make, cut_off_at):
    tok = make()
    r = get_renderer("chat_template", tok)
    turns = TURNS if make is chatml_tokenizer else TURNS[:2]  # Llama 3's template trims; "6 " would not match
    obs, actions, messages = play(r, tok.encode, turns, cut_off_at)
    assert_extends(obs, actions)
    whole = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.hf.decode(obs[-1], skip_special_tokens=False) == whole
    if cut_off_at == 0:  # the end-of-turn token was added after the cut-off sample
        assert obs[1][len(obs[0]) + len(actions[0])] == r.end_of_turn[0]


def test_a_template_that_rewrites_earlier_turns_is_refused_not_drifted():
    tok = byte_tokenizer(REWRITING, eos_token="<|im_end|>", bos_token="<|im_start|>")
    r = get_renderer("chat_template", tok)
    with pytest.raises(ValueError, match="cannot extend the previous one"):
        r.next_observation(r.build_generation_prompt([USER]), tok.encode("5") + list(r.end_of_turn), [USER])


# ---- base models ----


def test_role_colon_turns_and_multi_turn():
    tok = byte_tokenizer(None, eos_token="</s>")
    r = get_renderer("role_colon", tok)
    prompt = r.build_generation_prompt([{"role": "system", "content": "Be brief."}, USER])
    assert tok.decode(prompt) == "System: Be brief.\n\nUser: Guess a number from 0 to 9.\n\nAssistant:"
    assert r.stop_token_ids == (tok.eos_token_id,)  # "\n\n" is two tokens here: only EOS can stop
    assert r.parse_response(tok.encode(" 5\n\n")) == ({"role": "assistant", "content": "5"}, True)
    assert r.parse_response(tok.encode(" 5") + [tok.eos_token_id]) == ({"role": "assistant", "content": "5"}, True)
    assert r.parse_response(tok.encode(" 5\n\nUser: and"))[1] is False
    obs, actions, messages = play(r, lambda text: tok.encode(" " + text), cut_off_at=2)
    assert_extends(obs, actions)
    assert (
        tok.decode(obs[-1]) == "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"
    )


# ---- the real SmolLM2 tokenizer and model ----


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from headrace.models import ModelLoadError, model_dir
    from headrace.tokenizers.hf import HFTokenizer

    try:
        path = model_dir("smollm2-135m")  # converted once per machine, ~40 s; a cached load takes ~1 s
    except ModelLoadError as e:
        pytest.skip(str(e))
    return HFTokenizer(AutoTokenizer.from_pretrained(path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_chat_template_renders_exactly_as_its_template(smollm2):
    r = renderer_for("smollm2-135m", smollm2)
    assert r.name == "chat_template" and smollm2.hf.convert_ids_to_tokens(list(r.stop_token_ids)) == ["<|im_end|>"]
    obs, actions, messages = play(r, smollm2.encode)
    assert_extends(obs, actions)
    whole = smollm2.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm2.hf.decode(obs[-1], skip_special_tokens=False) == whole
    # ChatML's turn boundaries are special tokens, so even re-tokenising the whole text agrees here
    assert obs[-1] == smollm2.apply_chat_template(messages)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_smollm2_generation_stops_at_im_end(smollm2):
    from headrace.core.types import SamplingParams, StopReason
    from headrace.run.backends import make_backend
    from headrace.run.config import RunConfig

    r = renderer_for("smollm2-135m", smollm2)
    prompt = r.build_generation_prompt([{"role": "user", "content": "What is 2+3? Answer with the number only."}])
    async with make_backend(RunConfig(model="smollm2-135m", torch={"device": "cpu", "num_threads": 1})) as backend:
        out = await backend.sampling.sample(
            backend.initial_handle(),
            prompt,
            2,
            SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=r.stop_token_ids),
        )
    for sample in out:
        message, ok = r.parse_response(sample.tokens)
        assert sample.stop_reason == StopReason.STOP and sample.tokens[-1] == r.end_of_turn[0], message
        assert ok and "5" in message["content"]
