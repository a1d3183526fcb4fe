"""The sampler's fast paths must not change a number: prepacked bfloat16 weights, grouped-query
attention without repeated keys, and the two-level inverse-CDF draw (``draw.py``)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from headrace.backends.torch import fast_decode, generate  # noqa: E402
from headrace.backends.torch.draw import _inverse_cdf, _logprobs  # noqa: E402
from headrace.backends.torch.fast_decode import _PackedLinear, speed_up  # noqa: E402
from tests.torch_helpers import grouped_llama_config  # noqa: E402

needs_packing = pytest.mark.skipif(not fast_decode._packs(), reason="no oneDNN in this torch build")


@needs_packing
@pytest.mark.timeout(60)
def test_a_packed_linear_gives_the_plain_linears_bits_and_follows_a_new_weight():
    torch.manual_seed(0)
    plain = nn.Linear(96, 80, bias=False).to(torch.bfloat16)
    packed = nn.Linear(96, 80, bias=False).to(torch.bfloat16)
    packed.weight = plain.weight
    packed.__class__ = _PackedLinear
    with torch.no_grad():
        for rows in (1, 7, 64, 130):
            x = torch.randn(rows, 96, dtype=torch.bfloat16)
            assert torch.equal(packed(x), plain(x))
        strided = torch.randn(5, 9, 96, dtype=torch.bfloat16)[:, -1:, :]  # the prefill's last position
        assert torch.equal(packed(strided), plain(strided))
        plain.weight.data = torch.randn(80, 96, dtype=torch.bfloat16)  # a version swap: new storage
        x = torch.randn(64, 96, dtype=torch.bfloat16)
        assert torch.equal(packed(x), plain(x))
    x.requires_grad_(True)
    assert packed(x).requires_grad  # with gradients on, the plain path (the packed one has no backward)


@needs_packing
@pytest.mark.timeout(60)
@pytest.mark.parametrize("way", ["micro-kernel", "one matmul", "two matmuls"])
def test_the_packed_float32_logits_head_gives_the_learners_head_bits(monkeypatch, way):
    from headrace.backends.torch import brgemm, head

    if way == "micro-kernel":
        if not brgemm.available():
            pytest.skip("torch's bfloat16 micro-kernel does not run here")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the micro-kernel's condition
    else:
        if way == "one matmul" and not head.bf16_units():
            pytest.skip("no bfloat16 matrix units: the head takes two matmuls here")
        for module in (head, fast_decode):
            monkeypatch.setattr(module, "micro_kernel", lambda x, w: False)
        monkeypatch.setattr(head, "one_matmul", lambda x, w: way == "one matmul")
        monkeypatch.setattr(fast_decode, "one_matmul", lambda x, w: way == "one matmul")
    try:
        torch.manual_seed(0)
        weight = nn.Parameter(torch.randn(3000, 96).mul(0.1).to(torch.bfloat16), requires_grad=False)
        plain = head.Float32LogitsHead(weight)
        packed = head.Float32LogitsHead(weight)
        packed.__class__ = fast_decode._PackedFloat32LogitsHead
        assert head.micro_kernel(torch.ones(1, 96, dtype=torch.bfloat16), weight) == (way == "micro-kernel")
        with torch.no_grad():
            for rows in (1, 8, 64):
                x = torch.randn(rows, 96, dtype=torch.bfloat16)
                got = packed(x)
                assert got.dtype == torch.float32
                assert torch.equal(got, plain(x))
            weight.data = torch.randn(3000, 96, dtype=torch.bfloat16)  # a version swap: new storage
            x = torch.randn(2, 5, 96, dtype=torch.bfloat16)
            assert torch.equal(packed(x), plain(x))
    finally:
        if way == "micro-kernel":
            torch.set_num_threads(threads)


@pytest.mark.timeout(120)
def test_speed_up_keeps_a_bfloat16_llamas_decode_logits_bit_for_bit():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = grouped_llama_config()
    ref = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ref.set_attn_implementation("eager")
    fast = LlamaForCausalLM(copy.deepcopy(cfg)).to(torch.bfloat16).eval()  # its own config, as the sampler's
    fast.load_state_dict(ref.state_dict())
    fast.set_attn_implementation("eager")
    speed_up(fast)
    assert fast.config._attn_implementation == fast_decode.GROUPED_EAGER
    assert ref.config._attn_implementation == "eager"
    g = generate.Generator(ref, 0, torch.device("cpu"))
    h = generate.Generator(fast, 0, torch.device("cpu"))
    rows = [
        generate.Row(p, 8, 0.0, 1.0, 0, frozenset(), torch.Generator().manual_seed(1))
        for p in ([5, 6, 7, 8, 9], [11, 12], [5, 6, 7, 8, 9], [40, 41, 42])
    ]
    with torch.no_grad():
        a, b = g.generate(rows), h.generate(rows)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens
        assert x.logprobs == y.logprobs  # the very same floats


@pytest.mark.timeout(60)
def test_the_two_level_draw_picks_the_full_cumsums_token_and_never_a_zero_probability_one():
    gen = torch.Generator().manual_seed(0)
    for vocab in (5, 1024, 3000, 49152):
        # probabilities in multiples of 1/2**12: every partial sum is exact in float32, so the
        # one-level and the two-level search see the same numbers
        weights = torch.randint(0, 4, (16, vocab), generator=gen).float()
        weights[:, 0] += 1.0
        weights[:, vocab // 2 :: 7] = 0.0  # zero-probability runs inside blocks
        probs = weights / 2**12
        u = torch.rand(16, generator=gen)
        cdf = probs.cumsum(-1)
        want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=vocab - 1)
        got = _inverse_cdf(probs, u)
        assert torch.equal(got, want)
        assert bool((probs.gather(1, got[:, None]) > 0).all())
    # u at the very top: the round-off guard lands on the last token with mass, not on padding
    probs = torch.zeros(2, 2500)
    probs[:, 1200] = 1.0
    assert _inverse_cdf(probs, torch.tensor([0.0, 1.0])).tolist() == [1200, 1200]


@pytest.mark.timeout(60)
def test_the_drawn_tokens_logprobs_are_the_log_softmax_even_where_the_softmax_underflows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49152, generator=gen) * 4
    logits[3, 17] = logits[3].max() - 200.0  # e^-200: 0 in float32's softmax
    tokens = torch.randint(0, 49152, (8,), generator=gen)
    tokens[3] = 17
    want = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    got = _logprobs(logits, logits.softmax(-1), tokens)
    assert torch.isfinite(got).all()
    assert float((got - want).abs().max()) < 1e-5
    assert float(got[3]) == float(want[3])  # the underflowed one: the log-softmax itself


@pytest.mark.timeout(120)
def test_speed_up_keeps_a_bfloat16_lora_llamas_samples_bit_for_bit():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from headrace.backends.torch.lora import fuse_lora

    torch.manual_seed(0)
    cfg = grouped_llama_config()
    base = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    base.set_attn_implementation("eager")
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(base, lora, autocast_adapter_dtype=False)
    fuse_lora(peft_model)  # what the learner runs (model.py): the sampler must compute the same
    ref = peft_model.get_base_model()
    fast = copy.deepcopy(ref)
    speed_up(fast)
    assert sum(type(m).__name__ == "LeanLoraLinear" for m in fast.modules()) == 6  # 3 per layer
    rows = [
        generate.Row(p, 12, 1.0, 1.0, 0, frozenset(), torch.Generator().manual_seed(i))
        for i, p in enumerate(([5, 6, 7, 8, 9], [11, 12], [40, 41, 42]))
    ]
    with torch.no_grad():
        a = generate.Generator(ref, 0, torch.device("cpu")).generate(rows)
        rows = [
            generate.Row(r.prompt, 12, 1.0, 1.0, 0, frozenset(), torch.Generator().manual_seed(i))
            for i, r in enumerate(rows)
        ]
        b = generate.Generator(fast, 0, torch.device("cpu")).generate(rows)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens
        assert x.logprobs == y.logprobs
