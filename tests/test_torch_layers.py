"""The learner's Llama attention and MLP (layers.py) against transformers' modules: the same
forward bits in bfloat16 (the sampler keeps transformers' forward), gradients to round-off, and
the float32-logits head's arithmetic unchanged to the bit."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from tests.torch_helpers import grouped_llama_config  # noqa: E402


def _grouped_llama(dtype):
    """A small llama whose query heads share key heads (6 over 2), as SmolLM2's do."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(grouped_llama_config()).to(dtype).eval()
    model.set_attn_implementation("eager")
    return model


def _with_lora(model):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear

    from headrace.backends.torch.lora import fuse_lora

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    torch.manual_seed(1)  # the same adapters in both
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
    for m in peft_model.modules():  # a non-zero B, so the adapters' products count
        if isinstance(m, Linear):
            torch.nn.init.normal_(m.lora_B["default"].weight, std=0.05)
    fuse_lora(peft_model)
    return peft_model


def _pair(dtype, lora=True):
    from headrace.backends.torch.layers import replace_llama_layers

    plain = _grouped_llama(dtype)
    fast = copy.deepcopy(plain)
    assert replace_llama_layers(fast) == 4  # two attentions, two MLPs
    if lora:
        plain, fast = _with_lora(plain), _with_lora(fast)
    return plain, fast


def _batch():
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding, as the learner's padded rows have
    return ids, mask


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lora", [True, False])
def test_learner_layers_keep_a_bfloat16_llamas_logits_bit_for_bit_and_the_gradients(lora):
    from headrace.backends.torch import layers

    plain, fast = _pair(torch.bfloat16, lora)
    calls = []
    grouped = layers.grouped_attention

    def counting(*a, **k):
        calls.append(1)
        return grouped(*a, **k)

    ids, mask = _batch()
    out_p = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
    layers.grouped_attention = counting
    try:
        out_f = fast(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        layers.grouped_attention = grouped
    assert len(calls) == 2  # the fast path ran, in both layers
    # with LoRA the frozen base layers ran on packed weights (q, k, v, o, gate, up, down of each)
    assert sum(m in layers._PACKS for m in fast.modules()) == (14 if lora and layers._packs() else 0)
    assert torch.equal(out_f, out_p)
    grad = torch.randn(out_p.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    out_p.backward(grad)
    out_f.backward(grad)
    gp, gf = _grads(plain), _grads(fast)
    assert gp.keys() == gf.keys() and gp
    for name in gp:  # the keys' and values' gradients summed in another order: bf16 round-off
        err = (gf[name].float() - gp[name].float()).norm() / gp[name].float().norm()
        assert err < 0.03, name
    # without a gradient (the sampler's decode, forward-only calls): transformers' own forward
    with torch.no_grad():
        assert torch.equal(fast(input_ids=ids, attention_mask=mask).logits, out_p)


@pytest.mark.timeout(120)
def test_learner_layers_in_float32_agree_to_round_off():
    plain, fast = _pair(torch.float32)
    ids, mask = _batch()
    out_p = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
    out_f = fast(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out_f, out_p, rtol=1e-5, atol=1e-5)
    out_p.square().sum().backward()
    out_f.square().sum().backward()
    gp, gf = _grads(plain), _grads(fast)
    for name in gp:
        torch.testing.assert_close(gf[name], gp[name], rtol=1e-4, atol=1e-5)


def test_rotary_is_transformers_bit_for_bit_with_autograd_s_gradient():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from headrace.backends.torch.layers import rotary

    gen = torch.Generator().manual_seed(0)
    # a transposed view, as the projection's output is
    x = torch.randn(2, 7, 3, 16, generator=gen).transpose(1, 2)
    angles = torch.randn(2, 7, 8, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    for dtype in (torch.bfloat16, torch.float32):
        xd, c, s = x.to(dtype), cos.to(dtype), sin.to(dtype)
        ref, _ = apply_rotary_pos_emb(xd, xd, c, s)
        got = rotary(xd, c, s)
        assert torch.equal(got, ref) and got.is_contiguous()
    xr = x.clone().requires_grad_()
    xg = x.clone().requires_grad_()
    g = torch.randn(2, 3, 7, 16, generator=gen)
    apply_rotary_pos_emb(xr, xr, cos, sin)[0].backward(g)
    rotary(xg, cos, sin).backward(g)
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-6, atol=1e-6)


def test_grouped_attention_is_eager_bit_for_bit():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from headrace.backends.torch.layers import grouped_attention

    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    module.training = False
    for t in (1, 9):
        q = torch.randn(2, 6, t, 16, generator=gen).bfloat16()
        k, v = (torch.randn(2, 2, 9, 16, generator=gen).bfloat16() for _ in "kv")
        mask = torch.zeros(2, 1, t, 9).bfloat16()
        mask[0, :, :, :3] = torch.finfo(torch.bfloat16).min
        for m in (mask, mask.float(), None):  # a float32 mask promotes eager's weights
            ref = eager_attention_forward(module, q, k, v, m, 0.25)
            got = grouped_attention(q, k, v, m, 0.25)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_the_float32_logits_take_one_matmul_on_bf16_units_and_the_two_former_ones_elsewhere(monkeypatch):
    from headrace.backends.torch import head

    monkeypatch.setattr(head, "micro_kernel", lambda x, w: False)  # tests/test_torch_brgemm.py's

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(1000, 64, generator=gen) * 0.2).bfloat16()
    for rows in (1, 8, 64, 130):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        exact = x.double() @ w.double().t()
        rounded = x @ w.t()
        before = rounded.float().add_(torch.addmm(rounded.neg(), x, w.t()).float())
        got = head.float32_logits(x, w)
        assert got.dtype == torch.float32
        if head.one_matmul(x, w):
            # float32 arithmetic's sum of the exact products: closer than the two matmuls' ~3e-5
            assert (got.double() - exact).abs().max().item() < 2e-6 < (before.double() - exact).abs().max().item()
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch._C._get_fp32_precision_getter("mkldnn", "matmul") == "none"  # restored
        with monkeypatch.context() as m:  # a GPU, float16, a CPU without bfloat16 units
            m.setattr(head, "one_matmul", lambda x, w: False)
            assert torch.equal(head.float32_logits(x, w), before)  # the two matmuls' former bits


def test_the_heads_float32_weight_follows_the_weight(monkeypatch):
    from headrace.backends.torch import head

    monkeypatch.setattr(head, "micro_kernel", lambda x, w: False)  # tests/test_torch_brgemm.py's

    gen = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter((torch.randn(300, 32, generator=gen) * 0.2).bfloat16())
    x = torch.randn(4, 32, generator=gen).bfloat16()
    if not head.one_matmul(x, weight):
        pytest.skip("no bfloat16 matrix units: the head takes the two matmuls, no float32 copy")
    first = head.float32_logits(x, weight)
    with torch.no_grad():
        weight.mul_(2)  # an optimizer's step: the same storage, a new version
    assert torch.allclose(head.float32_logits(x, weight), 2 * first, rtol=1e-5, atol=1e-5)
    weight.data = weight.detach() * 0.5  # a version swap: new storage
    assert torch.allclose(head.float32_logits(x, weight), first, rtol=1e-5, atol=1e-5)
    assert id(weight) in head._COPIES
    key = id(weight)
    del weight
    import gc

    gc.collect()
    assert key not in head._COPIES  # the copy goes with its weight
