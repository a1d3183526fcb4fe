"""Models beyond the embedded one: the shipped tokenizer file, local directories, hub names
that cannot be fetched here, and the exports another sampler (vLLM) reads."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.torch_helpers import config, datum

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from headrace.backends.torch.model import ModelLoadError  # noqa: E402
from headrace.core.errors import ConfigError  # noqa: E402
from headrace.core.types import AdamParams, LossSpec, SamplingParams  # noqa: E402
from headrace.run.backends import make_backend  # noqa: E402
from headrace.tokenizers.char import CharTokenizer  # noqa: E402
from headrace.tokenizers.tiny_hf import ASSET_PATH, build_tokenizer, hf_tokenizer  # noqa: E402

TEXTS = ["12+30=", "What is 7*8? (a) b.", "unknown: ~é\n", ""]


def test_the_shipped_tokenizer_file_is_current_and_matches_the_char_tokenizer():
    assert json.loads(ASSET_PATH.read_text()) == json.loads(build_tokenizer().to_str()), (
        "headrace/assets/tokenizer.json is stale: run python -m headrace.tokenizers.tiny_hf"
    )
    chars, hf = CharTokenizer(), hf_tokenizer()
    assert len(hf) == chars.vocab_size and hf.eos_token_id == chars.eos_token_id
    for text in TEXTS:
        ids = chars.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids, skip_special_tokens=True) == chars.decode(ids)


@pytest.mark.timeout(60)
def test_a_hub_name_that_cannot_be_fetched_fails_fast_with_advice(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        make_backend(config().model_copy(update={"model": "Qwen/Qwen3-0.6B"}))
    assert time.perf_counter() - started < 20
    message = str(info.value)
    assert isinstance(info.value, ModelLoadError)
    assert "Qwen/Qwen3-0.6B" in message and "--model DIR" in message and "HF_HUB_OFFLINE" in message
    assert "\n" not in message


def test_a_missing_local_directory_is_named():
    with pytest.raises(ConfigError, match="model directory './no/such/model' does not exist"):
        make_backend(config().model_copy(update={"model": "./no/such/model"}))


@pytest.mark.timeout(120)
async def test_a_local_model_directory_loads_samples_and_trains(tmp_path):
    async with make_backend(config()) as tiny:
        model_dir = tiny.export_base_model(tmp_path / "tiny-model")
        h0 = tiny.initial_handle()
        prompt = tiny.tokenizer.encode("4+4=")
        reference = await tiny.sampling.sample(h0, prompt, 2, SamplingParams(max_tokens=4, seed=5))

    async with make_backend(config().model_copy(update={"model": model_dir})) as backend:
        assert backend.describe()["model"] == model_dir
        assert backend.tokenizer.encode("4+4=") == prompt and backend.tokenizer.eos_token_id == 2
        out = await backend.sampling.sample(backend.initial_handle(), prompt, 2, SamplingParams(max_tokens=4, seed=5))
        assert [s.tokens for s in out] == [s.tokens for s in reference]  # the same weights, loaded from disk
        datums = [datum(prompt, s) for s in out]
        result = await backend.training.forward_backward(datums, LossSpec("importance_sampling"))
        assert len(result.logprobs_D) == 2
        assert "optim/grad_norm" in (await backend.training.optim_step(AdamParams())).metrics


@pytest.mark.timeout(120)
async def test_a_published_full_fine_tune_exports_a_loadable_model_directory(tmp_path):
    async with make_backend(config()) as backend:
        prompt = backend.tokenizer.encode("1+8=")
        samples = await backend.sampling.sample(backend.initial_handle(), prompt, 4, SamplingParams(max_tokens=4))
        await backend.training.forward_backward([datum(prompt, s) for s in samples], LossSpec("importance_sampling"))
        await backend.training.optim_step(AdamParams(learning_rate=1e-2))
        handle = await backend.training.publish(1)
        out = await backend.sampling.sample(handle, prompt, 1, SamplingParams(max_tokens=4, seed=2))
        path = await asyncio.to_thread(handle.ref.save, tmp_path / "v1")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert transformers.AutoTokenizer.from_pretrained(path).encode("1+8=", add_special_tokens=False) == prompt
    ids = torch.tensor([prompt + out[0].tokens])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    got = logp.gather(-1, torch.tensor(out[0].tokens)[:, None]).squeeze(-1).tolist()
    assert got == pytest.approx(out[0].logprobs, abs=1e-4)


@pytest.mark.timeout(120)
async def test_a_published_lora_version_exports_a_peft_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    async with make_backend(config(lora_rank=4)) as backend:
        prompt = backend.tokenizer.encode("2+5=")
        samples = await backend.sampling.sample(backend.initial_handle(), prompt, 4, SamplingParams(max_tokens=4))
        await backend.training.forward_backward([datum(prompt, s) for s in samples], LossSpec("importance_sampling"))
        await backend.training.optim_step(AdamParams(learning_rate=1e-2))
        handle = await backend.training.publish(1)
        assert handle.ref.kind == "lora" and all(".default." in n for n in handle.ref.tensors)
        out = await backend.sampling.sample(handle, prompt, 1, SamplingParams(max_tokens=4, seed=2))
        base_dir = backend.export_base_model(tmp_path / "base")
        adapter_dir = handle.ref.save(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir))
    ids = torch.tensor([prompt + out[0].tokens])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    got = logp.gather(-1, torch.tensor(out[0].tokens)[:, None]).squeeze(-1).tolist()
    assert got == pytest.approx(out[0].logprobs, abs=1e-4)


async def test_a_tokenizer_that_does_not_match_the_model_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=10,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    small.save_pretrained(tmp_path / "mismatched")
    hf_tokenizer().save_pretrained(tmp_path / "mismatched")  # the char tokenizer: far more than 10 tokens
    with pytest.raises(ModelLoadError, match="do not belong together"):
        async with make_backend(config().model_copy(update={"model": str(tmp_path / "mismatched")})):
            pass
