"""The pieces of `headrace serve` without a server: the OpenAI request checks, stop strings,
advantages, the version chain, capture, the token rules, and the torch trainer's fork."""

from __future__ import annotations

import json

import pytest

from headrace.core.errors import ConfigError
from headrace.core.types import AdamParams, LossSpec, SampledTokens, SamplingParams, StopReason
from headrace.net.openai_wire import ApiError, answer, parse_chat, token_logprobs
from headrace.renderers import renderer_for
from headrace.run.config import RunConfig, build_config
from headrace.serve.candidates import make_batch
from headrace.serve.chain import VersionChain
from headrace.serve.run import api_token
from headrace.serve.store import Completion, FeedbackError, Store
from headrace.tokenizers.char import CharTokenizer

DEFAULTS = SamplingParams(max_tokens=8)
USER = [{"role": "user", "content": "hi"}]


def parse(**body):
    return parse_chat({"messages": USER} | body, {}, DEFAULTS, "tiny")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools[0].function.name"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"functions": [{"name": "f"}]}, 400, "functions"),
        ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c"}]}]}, 400, "messages[1].tool_calls[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, 400,
         "messages[0]"),
        ({"messages": [*USER, {"role": "function", "content": "42"}]}, 400, "messages[1]"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "assistant", "content": "only a prefill"}]}, 400, "messages"),
        ({"n": 2}, 400, "n"),
        ({"temperature": 3}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"top_k": 0}, 400, "top_k"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"seed": "7"}, 400, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"logprobs": "yes"}, 400, "logprobs"),
        ({"logprobs": True, "top_logprobs": 3}, 400, "top_logprobs"),
        ({"top_logprobs": -1}, 400, "top_logprobs"),
        ({"model": "gpt-4o"}, 404, "model"),
    ],
)  # fmt: skip
def test_a_bad_request_is_named_in_an_openai_error(body, status, param):
    with pytest.raises(ApiError) as caught:
        parse(**body)
    error = caught.value
    assert (error.status, error.param) == (status, param)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"} and str(error)


def test_a_json_answer_writes_non_finite_floats_as_the_strings_the_sdks_read_back():
    from headrace.net.http import Response

    plain = Response.of_json({"logprob": -0.5, "tokens": [1, 2]})
    assert json.loads(plain.body) == {"logprob": -0.5, "tokens": [1, 2]}
    odd = Response.of_json({"choices": [{"logprob": float("-inf"), "top": [float("nan"), 1.0]}], "x": float("inf")})
    assert json.loads(odd.body) == {"choices": [{"logprob": "-Infinity", "top": ["NaN", 1.0]}], "x": "Infinity"}


def test_tools_calls_and_results_are_taken():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    chat = parse(
        messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
                  {"role": "tool", "tool_call_id": "c1", "content": "1"}],
        tools=tools, tool_choice="auto",
    )  # fmt: skip
    assert chat.tools == tools and chat.read_calls
    assert chat.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}  # fmt: skip
    assert chat.messages[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}
    assert not parse(tools=tools, tool_choice="none").read_calls


def test_a_good_request_becomes_messages_params_and_a_prefill():
    chat = parse_chat(
        {
            "model": "tiny",
            "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [
                {"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]},
                {"role": "assistant", "content": "so"}],
            "max_tokens": 5, "max_completion_tokens": 3, "temperature": 0, "top_k": 5, "seed": 1, "stop": "x",
            "stream": True, "metadata": {"scenario": "meta"},
        },
        {"x-headrace-scenario": "header"}, DEFAULTS, "tiny",
    )  # fmt: skip
    assert chat.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two parts"}]
    assert chat.prefill == "so" and chat.stop == ("x",) and chat.stream and chat.scenario == "header"
    assert chat.params == SamplingParams(max_tokens=3, temperature=0.0, top_p=1.0, top_k=5, seed=1)
    assert parse(metadata={"scenario": "m"}).scenario == "m" and parse().params.max_tokens == 8


def test_a_stop_string_cuts_the_text_and_the_tokens_that_train():
    tok = CharTokenizer()
    renderer = renderer_for("tiny", tok)
    tokens = tok.encode("hello world") + [tok.eos_token_id]
    sample = SampledTokens(tokens, [-0.5] * len(tokens), StopReason.STOP)
    whole = answer(sample, renderer, ())
    assert (whole.text, whole.finish_reason, whole.tokens) == ("hello world", "stop", tokens)
    cut = answer(sample, renderer, ("lo w", "xyz"))
    assert cut.text == "hel" and cut.finish_reason == "stop"
    assert tok.decode(cut.tokens) == "hello w" and len(cut.logprobs) == len(cut.tokens)
    long = SampledTokens(tokens[:5], [-0.5] * 5, StopReason.LENGTH)
    assert answer(long, renderer, ()).finish_reason == "length"


def test_logprobs_are_the_sampled_tokens_own_without_the_end_of_turn():
    tok = CharTokenizer()
    renderer = renderer_for("tiny", tok)
    tokens = tok.encode("h!") + [tok.eos_token_id]
    ans = answer(SampledTokens(tokens, [-0.5, -1.5, -0.1], StopReason.STOP), renderer, ())
    content = token_logprobs(ans, tok.decode, renderer.stop_token_ids)["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [("h", -0.5), ("!", -1.5)]
    assert content[1]["bytes"] == [ord("!")] and content[1]["top_logprobs"] == []
    assert parse(logprobs=True, top_logprobs=0).logprobs and not parse().logprobs


def completion(cid: str, prompt: list[int], reward: float, scenario: str | None = "s", version: int = 0) -> Completion:
    c = Completion(cid, version, 0, prompt, [5, 6], [-1.0, -1.0], "stop", "ab", scenario)
    c.reward = reward
    return c


def advantages_of(batch) -> list[float]:
    return [d.advantages[-1] for d in batch.datums]


def test_one_prompt_is_a_group_and_lone_prompts_use_their_scenarios_baseline():
    group = [completion("g1", [1, 2], 1.0), completion("g2", [1, 2], 3.0)]
    alone = [completion("a", [3], 0.0), completion("b", [4], 4.0), completion("c", [5], 2.0, scenario="other")]
    batch = make_batch(group + alone, {"s": 1.0}, decay=0.5, normalize_std=False)
    # group: reward - its mean; 's' against its baseline 1.0; 'other' is new: against its batch's mean (itself)
    assert advantages_of(batch) == [-1.0, 1.0, -1.0, 3.0, 0.0]
    assert batch.baselines["other"] == 2.0
    s = 1.0
    for r in (1.0, 3.0, 0.0, 4.0):  # every reward of the scenario moves its baseline, in order
        s = 0.5 * s + 0.5 * r
    assert batch.baselines["s"] == pytest.approx(s)
    assert batch.datums[0].policy_version == 0 and batch.datums[0].logprobs[-2:] == [-1.0, -1.0]
    assert batch.metrics["batch/grouped"] == 2.0


def test_the_seed_systems_smoke_batch_has_advantages_around_its_mean():
    batch = make_batch([completion(str(r), [r], float(r)) for r in range(4)], {}, decay=0.9, normalize_std=False)
    assert advantages_of(batch) == [-1.5, -0.5, 0.5, 1.5]


def test_the_chain_names_the_incumbent_and_survives_a_torn_last_line(tmp_path):
    chain = VersionChain(tmp_path)
    chain.append("initial", 0, parent=None, checkpoint="c0")
    chain.append("published", 1, parent=0, checkpoint="c1", completions=["a", "b"], baselines={"s": 1.0})
    chain.append("rejected", 2, parent=1, completions=["c"], baselines={"s": 2.0})
    assert chain.incumbent().version == 1 and chain.next_version() == 3
    assert chain.used_completions() == {"a", "b", "c"} and chain.baselines() == {"s": 2.0}
    chain.rollback_to(0)
    assert (chain.incumbent().version, chain.incumbent().checkpoint) == (0, "c0") and chain.epochs_since(1) == 1
    with pytest.raises(ConfigError, match="never published"):
        chain.rollback_to(2)
    with open(chain.path, "a") as f:
        f.write('{"line": 4, "version": 3, "outc')  # kill -9 mid-write
    again = VersionChain(tmp_path)
    assert len(again.entries) == 4 and again.incumbent().version == 0
    lines = chain.path.read_text().splitlines()
    chain.path.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(ConfigError, match="line 2"):
        VersionChain(tmp_path)


def test_capture_is_read_back_and_feedback_is_checked(tmp_path):
    store = Store(tmp_path)
    store.add(completion("x", [1], 0.0))
    store.completions["x"].reward = None
    for cid, reward, status in (("nope", 1, 404), ("x", float("nan"), 400), ("x", True, 400), (3, 1, 400)):
        with pytest.raises(FeedbackError) as caught:
            store.check_feedback(cid, reward)
        assert caught.value.status == status
    c, r = store.check_feedback("x", 2)
    store.score(c, r)
    with pytest.raises(FeedbackError) as caught:
        store.check_feedback("x", 1)
    assert caught.value.status == 409
    store.close()
    with open(tmp_path / "completions.jsonl", "a") as f:
        f.write('{"id": "torn"')
    reread = Store(tmp_path)
    assert list(reread.completions) == ["x"] and reread.completions["x"].reward == 2.0
    record = json.loads((tmp_path / "completions.jsonl").read_text().splitlines()[0])
    assert "reward" not in record and record["prompt_tokens"] == [1]
    reread.close()


def test_the_token_rules(monkeypatch):
    monkeypatch.delenv("HEADRACE_API_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="HEADRACE_API_TOKEN"):
        api_token(RunConfig())
    monkeypatch.setenv("MY_TOKEN", "t0k")
    assert api_token(build_config(overrides=["serve.token_env=MY_TOKEN"])) == "t0k"
    assert api_token(build_config(overrides=["serve.no_auth=true"])) is None
    with pytest.raises(ConfigError, match="loopback"):
        api_token(build_config(overrides=["serve.no_auth=true", "serve.host=0.0.0.0"]))
    with pytest.raises(ConfigError, match="gate_env"):
        build_config(overrides=["serve.gate=env"])


async def test_a_torch_fork_trains_apart_from_its_incumbent_and_keeps_its_adam_state():
    torch = pytest.importorskip("torch")
    from headrace.run.backends import make_backend
    from tests.torch_helpers import config, datum

    async with make_backend(config()) as backend:
        incumbent = backend.training
        prompt = [3, 4, 5]
        sample = (await backend.sampling.sample(backend.initial_handle(), prompt, 1, SamplingParams(max_tokens=4)))[0]
        data = [datum(prompt, sample, 1.0)]
        loss, adam = LossSpec(), AdamParams(learning_rate=1e-2)
        await incumbent.forward_backward(data, loss)
        await incumbent.optim_step(adam)  # the incumbent has Adam moments the fork must carry
        before = {n: p.detach().clone() for n, p in incumbent.params.items()}
        candidate, twin, fresh = await incumbent.fork(), await incumbent.fork(), await incumbent.fork()
        fresh.optimizer = type(fresh.optimizer)(list(fresh.params.values()))  # the same weights, Adam from zero
        for trainer in (candidate, twin, fresh):
            await trainer.forward_backward(data, loss)
            await trainer.optim_step(adam)
        assert all(torch.equal(before[n], p) for n, p in incumbent.params.items())  # untouched
        assert any(not torch.equal(before[n], p) for n, p in candidate.params.items())
        # forks of one state take the same step, and it is not the step of the same weights with a fresh
        # Adam: the moments came along
        assert all(torch.equal(candidate.params[n], twin.params[n]) for n in candidate.params)
        assert any(not torch.allclose(candidate.params[n], fresh.params[n]) for n in candidate.params)
        await candidate.close()
