"""The learner's hand-written pieces against what they replace: the target logprobs (chunked
logsumexp), PEFT LoRA's fused plain case, the RMSNorm backward."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")


def test_target_logprobs_match_log_softmax_and_its_gradient_in_bfloat16():
    from headrace.backends.torch.scoring import TargetLogprobs

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 1000, generator=gen) * 4).bfloat16().requires_grad_()
    target = torch.randint(0, 1000, (37,), generator=gen)
    grad = torch.randn(37, generator=gen)
    ref = logits.float().log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)
    got = TargetLogprobs.apply(logits, target)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 1e-5
    (g_ref,) = torch.autograd.grad(ref, logits, grad)
    (g_got,) = torch.autograd.grad(got, logits, grad)
    assert g_got.dtype == torch.bfloat16
    assert (g_got.float() - g_ref.float()).abs().max().item() <= 2e-3 * g_ref.float().abs().max().item()


def test_the_chunked_target_logprobs_and_logits_gradient_are_log_softmax_s_bits():
    from headrace.backends.torch.scoring import LSE_ROWS, _logits_grad_rows, _target_logprobs

    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, LSE_ROWS, 3 * LSE_ROWS + 5):
            logits = (torch.randn(rows, 777, generator=gen) * 5).to(dtype)
            logits[0, :5] = -math.inf  # masked tokens
            target = torch.randint(5, 777, (rows,), generator=gen)
            # what the sampler computes: the log-softmax of the float32 logits, all rows at once
            whole = logits.float().log_softmax(-1)
            assert torch.equal(_target_logprobs(logits, target), whole.gather(-1, target[:, None]).squeeze(-1))
            grad = torch.randn(rows, generator=gen)
            got = _logits_grad_rows(logits, target, grad, torch.empty(rows, 777, dtype=torch.bfloat16))
            g = grad[:, None]
            part = whole.exp().mul_(-g).scatter_add_(-1, target[:, None], g)
            assert torch.equal(got, part.bfloat16())


def test_the_fused_head_and_target_logprobs_give_the_two_functions_bits():
    from headrace.backends.torch.head import Float32LogitsHead
    from headrace.backends.torch.scoring import HeadTargetLogprobs, TargetLogprobs

    gen = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter((torch.randn(3000, 64, generator=gen) * 0.2).bfloat16())
    hidden = (torch.randn(21, 64, generator=gen) * 3).bfloat16().requires_grad_()
    target = torch.randint(0, 3000, (21,), generator=gen)
    grad = torch.randn(21, generator=gen)
    apart = TargetLogprobs.apply(Float32LogitsHead(weight)(hidden), target)
    fused = HeadTargetLogprobs.apply(hidden, weight, target)
    assert torch.equal(apart, fused)
    g_apart = torch.autograd.grad(apart, (hidden, weight), grad)
    g_fused = torch.autograd.grad(fused, (hidden, weight), grad)
    for a, b in zip(g_apart, g_fused, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)


def test_a_wide_float32_head_takes_the_fused_logprobs_with_log_softmax_s_numbers_and_gradients():
    from headrace.backends.torch import scoring

    gen = torch.Generator().manual_seed(3)
    vocab = scoring.WIDE_VOCAB + 100
    head = torch.nn.Linear(64, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, 64, generator=gen) * 0.2)
    # logits of a real model's size (a row's top ~25-35, as SmolLM2's) and half the targets the
    # likeliest tokens (logprobs near 0, as sampled ones mostly are): x - logsumexp loses ~1e-5
    # there, where log-softmax's (x - max) - log(sum) keeps float32 round-off
    hidden = (torch.randn(21, 64, generator=gen) * 6).requires_grad_()
    target = torch.randint(0, vocab, (21,), generator=gen)
    target[::2] = head(hidden).argmax(-1)[::2]
    grad = torch.randn(21, generator=gen)
    assert scoring._wide_float32(head) and not scoring._wide_float32(torch.nn.Linear(64, 100, bias=False))
    ref = head(hidden).log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)
    got = scoring._head_logprobs(head, hidden, target)
    assert got.grad_fn is not None and "HeadTargetLogprobs" in type(got.grad_fn).__name__
    assert head(hidden).amax(-1).min() > 20
    # the sums' order (~1e-7 relative of the sum) plus two float32 steps of the logprob's size
    ulps = 1e-6 + 2.5e-7 * ref.detach().abs()
    assert ((got - ref).abs() <= ulps).all()
    g_ref = torch.autograd.grad(ref, (hidden, head.weight), grad)
    g_got = torch.autograd.grad(got, (hidden, head.weight), grad)
    for a, b in zip(g_ref, g_got, strict=True):
        assert b.dtype == torch.float32
        assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
    with torch.no_grad():  # the positions outside the loss: no gradient, the same numbers
        plain = scoring._head_logprobs(head, hidden, target, precise=False)
    assert ((plain - ref).abs() <= ulps).all()


def _lora_pair(dtype):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear

    from headrace.backends.torch.lora import FusedLoraLinear, fuse_lora

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 16)).to(dtype)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["0", "1"], lora_dropout=0.0)
    plain = get_peft_model(net, config, autocast_adapter_dtype=False)
    for m in plain.modules():  # a non-zero B, so the adapter's product counts
        if isinstance(m, Linear):
            torch.nn.init.normal_(m.lora_B["default"].weight, std=0.1)
    fused = copy.deepcopy(plain)
    fuse_lora(fused)
    assert sum(type(m) is FusedLoraLinear for m in fused.modules()) == 2
    assert all(type(m) is not FusedLoraLinear for m in plain.modules())
    return plain, fused


def test_fused_lora_computes_peft_s_forward_and_gradients():
    plain, fused = _lora_pair(torch.float32)
    x = torch.randn(3, 5, 32)
    out_p, out_f = plain(x), fused(x)
    assert out_f.shape == out_p.shape
    torch.testing.assert_close(out_f, out_p, rtol=1e-5, atol=1e-5)
    out_p.square().sum().backward()
    out_f.square().sum().backward()
    grads_p = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    grads_f = {n: p.grad for n, p in fused.named_parameters() if p.requires_grad}
    assert grads_p.keys() == grads_f.keys() and len(grads_p) == 4
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-5)


def test_fused_lora_in_bfloat16_is_close_and_a_disabled_adapter_is_the_base_exactly():
    plain, fused = _lora_pair(torch.bfloat16)
    x = torch.randn(4, 32).bfloat16()
    with torch.no_grad():
        diff = (fused(x).float() - plain(x).float()).abs().max().item()
        assert diff < 0.05 * plain(x).float().abs().max().item()
        with fused.disable_adapter(), plain.disable_adapter():
            assert torch.equal(fused(x), plain(x))
        base = plain(x)
        with fused.disable_adapter():
            assert not torch.equal(fused(x), base)  # the adapter did count before


def test_rms_norm_forward_is_transformers_bit_for_bit_and_its_gradients_agree():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from headrace.backends.torch.norms import RMSNorm, replace_rms_norms

    torch.manual_seed(0)
    ref = torch.nn.Sequential(LlamaRMSNorm(64, eps=1e-5)).bfloat16()
    with torch.no_grad():
        ref[0].weight.mul_(torch.rand(64).bfloat16() + 0.5)
    mine = copy.deepcopy(ref)
    assert replace_rms_norms(mine) == 1 and isinstance(mine[0], RMSNorm)
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = (torch.randn(3, 7, 64) * 3).bfloat16().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    a, b = ref(x), mine(x2)
    assert torch.equal(a, b)
    g = torch.randn_like(a)
    a.backward(g)
    b.backward(g)
    assert x.grad is not None and x2.grad is not None
    scale = x.grad.float().abs().max().item()
    assert (x.grad.float() - x2.grad.float()).abs().max().item() <= 1e-2 * scale
    w_ref, w_mine = ref[0].weight.grad, mine[0].weight.grad
    assert w_ref is not None and w_mine is not None
    assert (w_ref.float() - w_mine.float()).abs().max().item() <= 1e-2 * w_ref.float().abs().max().item()


def test_the_float32_logits_head_is_float32_accurate_packed_or_not_with_the_plain_heads_gradient():
    from headrace.backends.torch.fast_decode import _packs, speed_up
    from headrace.backends.torch.head import Float32LogitsHead, replace_head

    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(4096, 576, generator=gen) * 0.05).bfloat16())
    head = Float32LogitsHead(weight)
    x = torch.randn(64, 576, generator=gen).bfloat16()
    exact = x.double() @ weight.detach().double().t()
    with torch.no_grad():
        plain = (x @ weight.t()).double()
        got = head(x)
    assert got.dtype == torch.float32
    assert (plain - exact).abs().max().item() > 1e-3  # bfloat16 logits: a rounding step ~1e-2 here
    assert (got.double() - exact).abs().max().item() < 1e-4
    if _packs():  # the sampler's copy on prepacked weights: the same numbers at the same rows, bit for bit
        module = torch.nn.Sequential(copy.deepcopy(head))
        speed_up(module)
        assert type(module[0]) is not Float32LogitsHead
        with torch.no_grad():
            assert torch.equal(module[0](x), got)
            # other row counts round the error term differently, within float32-like bounds
            assert (module[0](x[:7]).double() - exact[:7]).abs().max().item() < 1e-4
    # the backward is the plain bfloat16 head's
    xg = x[:5].clone().requires_grad_()
    head(xg).sum().backward()
    x2, w2 = x[:5].clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (x2 @ w2.t()).float().sum().backward()
    assert xg.grad is not None and w2.grad is not None and weight.grad is not None
    assert torch.equal(xg.grad, x2.grad) and torch.equal(weight.grad, w2.grad)
    # only a plain low-precision Linear head is replaced, keeping its (tied) parameter
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).bfloat16()
    assert replace_head(model) and type(model.lm_head) is Float32LogitsHead
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not replace_head(LlamaForCausalLM(config))  # float32: left alone
