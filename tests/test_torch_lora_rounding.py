"""bfloat16 LoRA sums rounded once (``layers.with_adapter``): an adapter's contribution under half
a unit in the last place of the base's output still moves that output, in the learner's layers,
its forward-only calls, the sampler's layers and the sampler's decode step alike. Rounding the
base's product first and then the sum dropped those contributions, so early in training the
bfloat16 policy saw about half of each step (``benchmarks/bf16_update_check.py``)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from headrace.backends.torch import decode_step, fast_decode, layers  # noqa: E402
from tests.torch_helpers import grouped_llama_config  # noqa: E402

pytestmark = pytest.mark.skipif(not fast_decode._packs(), reason="no oneDNN in this torch build")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model():
    """A bfloat16 llama with LoRA whose ``B`` matrices are small, as after a first Adam step: most
    adapter contributions are under half a unit in the last place of the base's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from headrace.backends.torch.lora import fuse_lora

    torch.manual_seed(0)
    base = LlamaForCausalLM(grouped_llama_config()).to(torch.bfloat16).eval()
    base.set_attn_implementation("eager")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), lora_dropout=0.0)
    model = get_peft_model(base, config, autocast_adapter_dtype=False)
    fuse_lora(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 2e-4)
    return model.get_base_model()


def _parts(layer):
    from headrace.backends.torch.lora import plain_parts

    parts = plain_parts(layer)
    assert parts is not None
    return parts


def _once(layer, x):
    """The base's product plus the adapter's (``x A^T`` and the adapter's product each in
    bfloat16, as every path computes them), summed exactly and rounded once."""
    base, a, b, scaling = _parts(layer)
    xa = (x.double() @ a.weight.double().t()).bfloat16().double()
    delta = (xa @ b.weight.double().t() * scaling).bfloat16().double()
    return (x.double() @ base.weight.double().t() + delta).bfloat16()


def _twice(layer, x):
    """The old arithmetic: the base's product rounded, then the sum."""
    base, a, b, scaling = _parts(layer)
    xa = (x.double() @ a.weight.double().t()).bfloat16().double()
    delta = (xa @ b.weight.double().t() * scaling).bfloat16().double()
    return ((x.double() @ base.weight.double().t()).bfloat16().double() + delta).bfloat16()


def _differ(out, ref) -> float:
    return (out != ref).float().mean().item()


def _layers(model):
    block = model.model.layers[0]
    attn, mlp = block.self_attn, block.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


@pytest.mark.timeout(60)
def test_every_bfloat16_lora_path_rounds_the_adapters_sum_once():
    model = _model()
    sampler = copy.deepcopy(model)
    fast_decode.speed_up(sampler)
    plan = decode_step.plan_for(sampler)
    assert plan is not None
    plan.refresh()
    gen = torch.Generator().manual_seed(2)
    for layer, sampler_layer in zip(_layers(model), _layers(sampler), strict=True):
        x = torch.randn(64, layer.in_features, generator=gen).bfloat16()
        once, twice = _once(layer, x), _twice(layer, x)
        # the test can fail: rounding twice loses a share of these contributions
        assert _differ(twice, once) > 0.03, layer
        with torch.no_grad():
            outs = {
                "learner, forward only": layer(x),
                "learner's group": layers.project(x, [layer])[0],
                "sampler's layer": sampler_layer(x),
            }
        outs["learner, with a gradient"] = layer(x).detach()
        for path, out in outs.items():  # float32 sums in another order: a rare tie rounds apart
            assert _differ(out, once) < 0.002, path
    block = plan.blocks[0]
    q, k, v, o, gate, up, down = _layers(model)
    for group, members in ((block.qkv, [q, k, v]), (block.o, [o]), (block.gate_up, [gate, up]), (block.down, [down])):
        x = torch.randn(64, members[0].in_features, generator=gen).bfloat16()
        with torch.no_grad():
            out = group(x)
        assert _differ(out, torch.cat([_once(m, x) for m in members], -1)) < 0.002, members[0]
