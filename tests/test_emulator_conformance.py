"""Any Tinker client runs against the emulator unchanged, through the official SDK: every
base-model name is served (unless ``--serve-only``), stop strings end a sample as on the
service, prompt logprobs (and top-k prompt logprobs) are computed for real, a token id outside
the model's vocabulary is a 400 naming its size, and the bigram compute takes any id below
``--vocab-size`` in memory O(V), honouring top_k/top_p. Both computes where it matters."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker_support import tinker_env  # noqa: E402, F401 - fixture

from headrace.tinker_emulator import EmulatorThread  # noqa: E402
from headrace.tokenizers.char import CharTokenizer  # noqa: E402

pytestmark = [pytest.mark.tinker, pytest.mark.timeout(120)]
CHARS = CharTokenizer()


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _prompt(ids: list[int]) -> types.ModelInput:
    return types.ModelInput.from_ints(ids)


async def _closed(service: tinker.ServiceClient) -> None:
    await asyncio.wait_for(service.close("success"), 10)


# -- names -----------------------------------------------------------------------------------------


async def test_any_base_model_name_is_served_and_the_listing_says_so():
    with EmulatorThread(compute="bigram") as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4, seed=0)
        out = await client.forward_backward([_datum([5, 6, 7, 8])], "cross_entropy")
        assert out.loss_fn_outputs[0]["logprobs"].shape == [3]
        info = client.get_info()
        assert info.model_data.model_name == "Qwen/Qwen3-8B"  # the client's name, as the service answers
        base = await service.create_sampling_client(base_model="meta-llama/Llama-3.1-8B")
        sampled = await base.sample(_prompt([5, 6]), 2, types.SamplingParams(max_tokens=4, seed=0))
        assert len(sampled.sequences) == 2
        await _closed(service)
        assert emu.models()[client.model_id]["base_model"] == "Qwen/Qwen3-8B"
        listing = tinker.RestClient(base_url=emu.url, api_key="tml-test").get_server_capabilities().result()
        names = [m.model_name for m in listing.supported_models]
    assert names == ["tiny", "* (any base model name; computed by tiny)"]


# -- stop strings and stop tokens ----------------------------------------------------------------


def _check_stops(sequences, stops: list[str]) -> int:
    """Every sample ends at the first token that completes a stop string, or holds none. Returns
    how many stopped on a string."""
    hits = 0
    for seq in sequences:
        text, before = CHARS.decode(seq.tokens), CHARS.decode(seq.tokens[:-1])
        if any(s in text for s in stops):
            assert seq.stop_reason == "stop" and not any(s in before for s in stops), (seq.tokens, text)
            hits += 1
    return hits


async def test_stop_strings_end_a_bigram_sample_after_the_token_that_completes_them():
    with EmulatorThread(compute="bigram") as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
        pattern = CHARS.encode("1+2+1+2+1+2+1+2+1+2+")
        for _ in range(8):  # learn the pattern, so a multi-token stop string comes up
            fb = client.forward_backward([_datum(pattern)], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=0.3))
            await fb
        sampler = await client.save_weights_and_get_sampling_client()
        prompt = _prompt(CHARS.encode("1+"))
        params = types.SamplingParams(max_tokens=12, seed=1, stop=["+1+"])
        out = await sampler.sample(prompt, 16, params)
        assert _check_stops(out.sequences, ["+1+"]) >= 12  # the pattern is learnt: most samples hit it
        one = await sampler.sample(prompt, 16, types.SamplingParams(max_tokens=12, seed=1, stop="2"))
        assert _check_stops(one.sequences, ["2"]) >= 12
        never = await sampler.sample(prompt, 8, types.SamplingParams(max_tokens=12, seed=1, stop=[]))
        assert all(s.stop_reason == "length" and len(s.tokens) == 12 for s in never.sequences)  # [] turns EOS off
        two = CHARS.encode("2")[0]
        by_id = await sampler.sample(prompt, 8, types.SamplingParams(max_tokens=12, seed=1, stop=[two]))
        for seq in by_id.sequences:  # a stop token is kept as the sample's last token
            assert seq.stop_reason == "length" or seq.tokens[-1] == two
        assert sum(s.stop_reason == "stop" for s in by_id.sequences) >= 6
        await _closed(service)


# -- prompt logprobs -----------------------------------------------------------------------------


async def _prompt_logprobs_are_the_models(url: str, prompt_ids: list[int], tol: float) -> None:
    """The sampler's prompt logprobs agree with its sampled logprobs and with the trainer's
    forward on the same weights; top-k prompt logprobs hold the prompt token where it ranks."""
    service = tinker.ServiceClient(base_url=url, api_key="tml-test")
    client = await service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4, seed=0)
    fb = client.forward_backward([_datum(prompt_ids)], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=0.05))
    await fb
    sampler = await client.save_weights_and_get_sampling_client()
    out = await sampler.sample(
        _prompt(prompt_ids),
        2,
        types.SamplingParams(max_tokens=6, seed=3, stop=[]),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    )
    lps, topk = out.prompt_logprobs, out.topk_prompt_logprobs
    assert lps is not None and topk is not None and len(lps) == len(topk) == len(prompt_ids)
    assert lps[0] is None and topk[0] is None and all(lp is not None and lp < 0 for lp in lps[1:])
    for i in range(1, len(prompt_ids)):
        ranked = topk[i]
        assert ranked is not None and len(ranked) == 3
        assert [lp for _, lp in ranked] == sorted((lp for _, lp in ranked), reverse=True)
        assert ranked[0][1] >= lps[i] - tol  # the top one is at least as likely as the prompt's own
        for tok, lp in ranked:
            if tok == prompt_ids[i]:
                assert math.isclose(lp, lps[i], abs_tol=tol)
    # the trainer's forward on the same weights, and the sampler's own logprobs of what it drew
    seq = out.sequences[0]
    whole = prompt_ids + list(seq.tokens)
    forward = await client.forward([_datum(whole)], "cross_entropy")
    forward_lps = forward.loss_fn_outputs[0]["logprobs"].tolist()
    again = await sampler.compute_logprobs(_prompt(whole))
    assert again[0] is None
    assert np.allclose(again[1:], forward_lps, atol=tol), (again, forward_lps)
    assert np.allclose(again[len(prompt_ids) :], seq.logprobs, atol=tol)
    last = await sampler.sample(
        _prompt(prompt_ids),
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        prompt_logprobs_last_n=2,
    )
    assert last.prompt_logprobs is not None
    assert last.prompt_logprobs[:-2] == [None] * (len(prompt_ids) - 2)
    assert np.allclose(last.prompt_logprobs[-2:], lps[-2:], atol=tol)
    await _closed(service)


async def test_prompt_logprobs_on_the_bigram_compute():
    with EmulatorThread(compute="bigram") as emu:
        await _prompt_logprobs_are_the_models(emu.url, [5, 6, 40_000, 7, 65_535, 8], tol=1e-4)


@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
@pytest.mark.timeout(240)
async def test_prompt_logprobs_and_stop_strings_on_the_torch_compute():
    with EmulatorThread(compute="torch") as emu:
        await _prompt_logprobs_are_the_models(emu.url, CHARS.encode("12+30=42"), tol=2e-4)
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        sampler = await service.create_sampling_client(base_model="Qwen/Qwen3-8B")
        out = await sampler.sample(
            _prompt(CHARS.encode("1+2=")), 32, types.SamplingParams(max_tokens=16, seed=0, stop=["1", "2"])
        )
        assert _check_stops(out.sequences, ["1", "2"]) >= 8
        await _closed(service)


# -- vocabulary ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("compute", "vocab"), [("bigram", 1000), ("torch", CHARS.vocab_size)])
async def test_a_token_outside_the_vocabulary_is_a_400_naming_its_size(compute, vocab):
    with EmulatorThread(compute=compute, vocab_size=vocab if compute == "bigram" else None) as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4, seed=0)
        says = rf"400.*token id {vocab}, outside the served model's vocabulary of {vocab} token ids"
        with pytest.raises(tinker.BadRequestError, match=says):
            await client.forward_backward([_datum([5, 6, vocab])], "cross_entropy")
        await client.forward_backward([_datum([5, 6, vocab - 1])], "cross_entropy")  # the last id is fine
        sampler = await client.save_weights_and_get_sampling_client()
        with pytest.raises(tinker.BadRequestError, match=says):
            await sampler.sample(_prompt([5, vocab]), 1, types.SamplingParams(max_tokens=2))
        with pytest.raises(tinker.BadRequestError, match="token id -1, outside"):
            await sampler.sample(_prompt([5, -1]), 1, types.SamplingParams(max_tokens=2))
        await _closed(service)
        fbs = [r for r in emu.log() if r["event"] == "op" and r["op"] == "forward_backward"]
    assert len(fbs) == 1  # the refused one never reached the queue


# -- the bigram compute at the default vocabulary: any id, top_k/top_p, memory --------------------


async def test_bigram_takes_ids_across_the_default_vocabulary_and_learns_them():
    with EmulatorThread(compute="bigram") as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8, seed=0)
        tokens = [65_535, 30_000, 5, 65_535, 30_000, 5, 65_535, 30_000]
        losses = []
        for _ in range(6):
            fb = client.forward_backward([_datum(tokens)], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=0.5))
            losses.append((await fb).metrics["loss:sum"])
        # 5 of the 7 targets start at logprob ~ -34 (outside the base model's character ids)
        assert losses[0] > 5 * 30 and losses[-1] < losses[0] / 2, losses
        await _closed(service)


async def test_bigram_honours_top_k_and_top_p():
    with EmulatorThread(compute="bigram") as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
        # after '+' come 1, 2, 3 and 4, four, three, two and one times: ten steps order them so, with no
        # ties (one Adam step moves every target seen alike, and a tie's winner is numpy's choice)
        for _ in range(10):
            fb = client.forward_backward([_datum(CHARS.encode("+1+1+1+1+2+2+2+3+3+4"))], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=0.1))
            await fb
        sampler = await client.save_weights_and_get_sampling_client()
        prompt = CHARS.encode("1+")
        scored = await sampler.sample(
            _prompt([*prompt, 0]), 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=4
        )
        ranked = scored.topk_prompt_logprobs[-1]  # the distribution after the prompt
        assert ranked[0][1] > ranked[1][1] > ranked[2][1], ranked  # a unique top one and top two
        first = lambda out: {s.tokens[0] for s in out.sequences}  # noqa: E731

        def params(**kw):
            return types.SamplingParams(max_tokens=1, seed=7, stop=[], **kw)

        plain = await sampler.sample(_prompt(prompt), 64, params())
        top2 = await sampler.sample(_prompt(prompt), 64, params(top_k=2))
        nucleus = await sampler.sample(_prompt(prompt), 64, params(top_p=1e-6))
        assert len(first(plain)) > 2  # without top-k, more than two first tokens come up
        assert first(top2) <= {tok for tok, _ in ranked[:2]}
        assert first(nucleus) == {ranked[0][0]}  # a tiny nucleus holds the most likely token only
        for seq in top2.sequences:  # reported logprobs are the model's, not the shaped distribution's
            assert math.isclose(seq.logprobs[0], dict(ranked)[seq.tokens[0]], abs_tol=1e-4)
        await _closed(service)


_MEMORY_PROBE = textwrap.dedent(
    """
    import asyncio, json, resource
    import tinker
    from tinker import types
    from headrace.tinker_emulator import EmulatorThread

    def hwm():  # VmHWM: this process's own peak (ru_maxrss keeps the forking pytest's across exec)
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])

    def datum(tokens):
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})

    async def main():
        before = hwm()
        with EmulatorThread(compute="bigram") as emu:  # the default --vocab-size: 65,536
            service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
            client = await service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=32, seed=0)
            batch = [datum([(97 * (i + 16 * j)) % 65_536 for i in range(64)]) for j in range(16)]
            for _ in range(3):
                fb = client.forward_backward(batch, "cross_entropy")
                client.optim_step(types.AdamParams(learning_rate=0.01))
                await fb
            sampler = await client.save_weights_and_get_sampling_client()
            await sampler.sample(types.ModelInput.from_ints(list(range(0, 65_536, 4096))), 16,
                                 types.SamplingParams(max_tokens=32, seed=0),
                                 include_prompt_logprobs=True, topk_prompt_logprobs=5)
            await service.close("success")
        after = hwm()
        print(json.dumps({"before_kib": before, "peak_kib": after}))

    asyncio.run(main())
    """
)


@pytest.mark.slow
def test_bigram_memory_at_the_default_vocabulary_stays_under_a_gigabyte():
    """Before: two dense V x V float64 tables per model, 34 GB each at 65,536 ids."""
    env = {
        **os.environ,
        "TINKER_TELEMETRY": "0",
    }  # nothing leaves the machine; 16 s alone, far longer on a loaded CI box
    run = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, timeout=280, check=False, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["peak_kib"] < 1024 * 1024, figures  # ru_maxrss is in KiB on Linux
