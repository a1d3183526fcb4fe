"""MFU in every row (issue 24, item 1): FLOPs counted from the model's shape and the tokens each
phase processed, the device's peak probed once per machine in the dtype used, ``perf/…`` in the
optim step's metrics; and the dtype/device choice of ``torch.dtype=auto`` (item 2), without CUDA."""

from __future__ import annotations

import json

import pytest

from tests.torch_helpers import config

torch = pytest.importorskip("torch")

from headrace.backends.torch import flops  # noqa: E402
from headrace.backends.torch.flops import ModelShape, PerfMeter, causal_pairs, peak_flops  # noqa: E402
from headrace.backends.torch.model import tiny_llama_config  # noqa: E402
from headrace.core.types import AdamParams, LossSpec, SamplingParams  # noqa: E402
from headrace.run.backends import make_backend  # noqa: E402
from headrace.tokenizers.char import CharTokenizer  # noqa: E402
from tests.test_torch_backend import sample_datums  # noqa: E402


def tiny_model():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(CharTokenizer().vocab_size))


def test_the_shape_counts_every_matmul_but_the_head():
    model = tiny_model()
    shape = ModelShape.of(model)
    cfg = model.config
    d, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    assert shape.matmul_params == L * (4 * d * d + 3 * d * i)  # q, k, v, o; gate, up, down
    assert shape.trainable_matmul_params == shape.matmul_params and shape.layers == L
    assert shape.attention_width == d and shape.vocab == cfg.vocab_size
    # one token attending to itself: 2 FLOPs per parameter, 4 per (layer, width), the head's 2dV
    assert shape.forward(1, 1, 1) == 2 * shape.matmul_params + 4 * L * d + 2 * d * cfg.vocab_size
    assert causal_pairs(2, 3) == 2 * (1 + 2 + 3)
    # frozen weights: the backward skips their weight gradients
    model.requires_grad_(False)
    frozen = ModelShape.of(model)
    assert frozen.backward(10, 55, 4) < shape.backward(10, 55, 4)
    assert frozen.backward(10, 55, 0) == pytest.approx(2 * frozen.matmul_params * 10 + 8 * L * d * 55)


def test_the_meter_reports_each_phase_against_the_peak():
    meter = PerfMeter(lambda: 100.0)
    assert meter.drain() == {}
    meter.add("train", flops=60.0, seconds=2.0, tokens=8)
    meter.add("prefill", flops=10.0)
    meter.add("decode", flops=30.0, tokens=4)
    meter.add("sample", seconds=1.0)
    row = meter.drain()
    assert row["perf/train_flops_per_s"] == 30.0 and row["perf/mfu_train"] == pytest.approx(0.3)
    assert row["perf/sample_flops_per_s"] == 40.0 and row["perf/mfu_sample"] == pytest.approx(0.4)
    assert row["perf/sample_tokens_per_s"] == 4.0 and row["perf/train_tokens_per_s"] == 4.0
    assert meter.drain() == {}  # drained: the next row counts from zero


def test_the_peak_is_probed_once_per_machine_and_dtype(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(flops, "probe_peak", lambda device, dtype: calls.append(dtype) or 1e9)
    path = tmp_path / "peak.json"
    cpu = torch.device("cpu")
    assert peak_flops(cpu, torch.float32, path) == 1e9
    assert peak_flops(cpu, torch.float32, path) == 1e9
    assert peak_flops(cpu, torch.bfloat16, path) == 1e9
    assert calls == [torch.float32, torch.bfloat16]
    assert len(json.loads(path.read_text())) == 2
    path.write_text("not json")  # a damaged cache is probed again, not fatal
    assert peak_flops(cpu, torch.float32, path) == 1e9 and len(calls) == 3


def test_a_real_probe_measures_a_positive_rate():
    assert flops.probe_peak(torch.device("cpu"), torch.float32, size=64, repeats=1) > 0


@pytest.mark.timeout(60)
async def test_an_optim_step_reports_mfu_for_training_and_sampling(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(flops, "PROBE_SIZE", 128)
    async with make_backend(config(lora_rank=4)) as backend:
        handle = backend.initial_handle()
        datums = await sample_datums(backend, handle)
        await backend.training.forward_backward(datums, LossSpec("importance_sampling"))
        row = (await backend.training.optim_step(AdamParams(learning_rate=1e-3))).metrics
        for key in ("perf/mfu_train", "perf/mfu_sample", "perf/train_flops_per_s", "perf/sample_tokens_per_s"):
            assert row[key] > 0, key
        assert row["perf/prefill_flops"] > 0 and row["perf/decode_flops"] > 0
        # the decode loop ran for part of the wall time since the backend's first job
        assert 0.0 < row["perf/sampler_busy"] <= 1.0 and row["perf/decode_rows"] >= 1
        assert (tmp_path / "cache" / "headrace" / "peak_flops.json").exists()
        await backend.sampling.sample(handle, [1, 2, 3], 2, SamplingParams(max_tokens=3))
        later = (await backend.training.optim_step(AdamParams(learning_rate=1e-3))).metrics
        assert "perf/mfu_train" not in later and later["perf/sample_tokens_per_s"] > 0  # only what ran since


def test_auto_picks_bfloat16_only_where_the_hardware_multiplies_it():
    from headrace.backends.torch.model import TINY, choose_dtype, has_bf16_matrix_units

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    amx, avx512, old = frozenset({"avx2", "amx_bf16"}), frozenset({"avx512f", "avx512_bf16"}), frozenset({"avx2"})
    assert has_bf16_matrix_units(cpu, amx) and has_bf16_matrix_units(cpu, avx512)
    assert not has_bf16_matrix_units(cpu, old)
    assert has_bf16_matrix_units(cuda, capability=(8, 0)) and has_bf16_matrix_units(cuda, capability=(9, 0))
    assert not has_bf16_matrix_units(cuda, capability=(7, 5))  # a T4: fp16 tensor cores, no bfloat16
    assert choose_dtype("auto", "smollm2-135m", cpu, amx) == "bfloat16"
    assert choose_dtype("auto", "smollm2-135m", cpu, old) == "float32"
    assert choose_dtype("auto", "smollm2-135m", cuda, capability=(9, 0)) == "bfloat16"
    assert choose_dtype("auto", "smollm2-135m", cuda, capability=(7, 0)) == "float32"
    assert choose_dtype("auto", TINY, cpu, amx) == "float32"  # measured faster in float32
    assert choose_dtype("float32", "smollm2-135m", cpu, amx) == "float32"  # one option away
    assert choose_dtype("bfloat16", TINY, cpu, old) == "bfloat16"


@pytest.mark.timeout(60)
async def test_the_backend_says_which_dtype_auto_chose():
    async with make_backend(config()) as backend:  # tiny, dtype auto
        assert backend.describe()["dtype"] == "float32" and backend.config.dtype == "float32"


@pytest.mark.timeout(90)
async def test_bfloat16_full_fine_tuning_steps_float32_masters(tmp_path):
    async with make_backend(config(tmp_path, dtype="bfloat16", lora_rank=0)) as backend:
        trainer = backend.training
        name, weight = next(iter(trainer.params.items()))
        assert weight.dtype == torch.bfloat16 and trainer._masters[name].dtype == torch.float32
        before = trainer._masters[name].detach().clone()
        datums = await sample_datums(backend, backend.initial_handle())
        await trainer.forward_backward(datums, LossSpec("importance_sampling"))
        await trainer.optim_step(AdamParams(learning_rate=1e-4))
        master = trainer._masters[name]
        moments = trainer.optimizer.state[master]
        assert moments["exp_avg"].dtype == torch.float32 and weight.grad is None
        # a step smaller than bfloat16's resolution is kept by the master, and the model holds it rounded
        assert not torch.equal(master, before)
        assert torch.equal(weight, master.to(torch.bfloat16))
        path = await trainer.save_state("step_1")
        saved = master.detach().clone()
        master.data.zero_()
        await trainer.load_state(path)
        assert torch.equal(master, saved)  # the checkpoint holds the float32 masters
        assert torch.equal(weight, master.to(torch.bfloat16))


def test_auto_attention_is_eager_on_a_cpu_and_sdpa_elsewhere():
    from headrace.backends.torch.model import choose_attention
    from headrace.core.errors import ConfigError

    assert choose_attention("auto", torch.device("cpu")) == "eager"
    assert choose_attention("auto", torch.device("cuda")) == "sdpa"
    assert choose_attention("sdpa", torch.device("cpu")) == "sdpa"
    with pytest.raises(ConfigError, match="torch.attention='flash' is not one of auto, eager, sdpa"):
        choose_attention("flash", torch.device("cpu"))


@pytest.mark.timeout(60)
async def test_bfloat16_lora_adapters_step_through_float32_masters():
    async with make_backend(config(dtype="bfloat16", lora_rank=4)) as backend:
        trainer = backend.training
        assert {p.dtype for p in trainer.params.values()} == {torch.bfloat16}  # computed in bfloat16
        assert trainer._masters and {m.dtype for m in trainer._masters.values()} == {torch.float32}
        hf_config = backend.loaded.model.get_base_model().config
        assert hf_config._attn_implementation == "eager"
        await backend.sampling.sample(backend.initial_handle(), [1, 2, 3], 2, SamplingParams(max_tokens=3))
        assert hf_config._attn_implementation == "eager"  # the sampler's too: the same numerics
