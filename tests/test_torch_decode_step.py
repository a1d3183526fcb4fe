"""The sampler's written-out decode step (``decode_step.py``), in bfloat16 and in float32: stacked
projections give the separate layers' bits, a batch decoded by it (rows joining, leaving, new
weights mid-way) samples what transformers' forward samples, and models it does not compute keep
transformers' forward."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from headrace.backends.torch import decode_step, fast_decode, generate  # noqa: E402
from headrace.backends.torch.fast_decode import speed_up  # noqa: E402
from tests.torch_helpers import grouped_llama_config  # noqa: E402

pytestmark = pytest.mark.skipif(not fast_decode._packs(), reason="no oneDNN in this torch build")

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])


def _lora_llama(
    targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"), alpha=8, dropout=0.0, dtype=torch.bfloat16, **cfg_kw
):
    """A grouped-query llama with LoRA (random adapters) in ``dtype``, as the learner holds it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from headrace.backends.torch.lora import fuse_lora

    torch.manual_seed(0)
    cfg = grouped_llama_config()
    for k, v in cfg_kw.items():
        setattr(cfg, k, v)
    base = LlamaForCausalLM(cfg).to(dtype).eval()
    base.set_attn_implementation("eager")
    lora = LoraConfig(
        r=4, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, lora_dropout=dropout
    )
    model = get_peft_model(base, lora, autocast_adapter_dtype=False)
    fuse_lora(model)
    return model.get_base_model()


def _sampler_copy(model: nn.Module) -> nn.Module:
    fast = copy.deepcopy(model)
    speed_up(fast)
    return fast


def _new_adapters(model: nn.Module, seed: int) -> None:
    """A version swap as the sampler does it: each adapter tensor pointed at new storage."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype)


@pytest.mark.timeout(60)
@DTYPES
def test_stacked_projections_give_the_separate_layers_bits_and_follow_new_adapters(dtype):
    fast = _sampler_copy(_lora_llama(dtype=dtype))
    plan = decode_step.plan_for(fast)
    assert plan is not None
    layer = fast.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    block = plan.blocks[0]
    groups = [
        (block.qkv, [attn.q_proj, attn.k_proj, attn.v_proj]),  # k without an adapter: a zero block
        (block.o, [attn.o_proj]),
        (block.gate_up, [mlp.gate_proj, mlp.up_proj]),
        (block.down, [mlp.down_proj]),
    ]
    with torch.no_grad():
        for swap in (None, 1):
            if swap is not None:
                _new_adapters(fast, swap)
            plan.refresh()
            for rows in (1, 7, 64):
                for group, layers in groups:
                    x = torch.randn(rows, layers[0].in_features, dtype=dtype)
                    assert torch.equal(group(x), torch.cat([m(x) for m in layers], -1))


def _rows(prompts, max_tokens, seed0, temperature=1.0):
    return [
        generate.Row(p, n, temperature, 1.0, 0, frozenset(), torch.Generator().manual_seed(seed0 + i))
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
    ]


def _run(model: nn.Module, plan_on: bool) -> tuple[list, int]:
    """A batch decoded with rows of several prompt lengths and lengths (so members leave mid-way),
    a second batch joining it, then new adapters (kept cache), then new adapters again
    (recomputed cache): every row's results, and how often the KV slots were built."""
    g = generate.Generator(model, 0, torch.device("cpu"))
    if not plan_on:
        g.plan = None
    built = 0
    slots_of = decode_step.KVSlots.of

    def counting(*args):
        nonlocal built
        built += 1
        return slots_of(*args)

    decode_step.KVSlots.of = staticmethod(counting)  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            first = [
                generate.Member("a", _rows([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]], [10, 10], 0)),
                generate.Member("b", _rows([[11, 12]], [3], 2, temperature=0.0)),
                generate.Member("c", _rows([[40, 41, 42]], [14], 3)),
            ]
            batch = generate.Generation(g, first)
            batch.advance(2)
            joiner = generate.Member("d", _rows([[7, 7, 7, 7, 7, 7, 7, 1]], [9], 4))
            other = generate.Generation(g, [joiner])
            batch.absorb(other)
            batch.advance(3)  # "b" ends and leaves meanwhile
            _new_adapters(model, 10)
            batch.reweigh(1, "keep")
            batch.advance(2)
            _new_adapters(model, 11)
            batch.reweigh(2, "recompute")
            batch.advance(None)
    finally:
        decode_step.KVSlots.of = slots_of  # type: ignore[method-assign]
    results = [r for m in [*first, joiner] for r in m.results()]
    return results, built


def _same_samples(planned: list, plain: list, dtype) -> float:
    """Each row's tokens, versions and stop reason the same, its logprobs within round-off (in
    bfloat16 on this small model the same floats; SmolLM2's, and float32's here, differ by float
    round-off: attention's float32 sums run over the whole buffer, masked columns included,
    benchmarks/RESULTS.md, "A decode step written out"): the largest logprob gap."""
    gaps = [0.0]
    for x, y in zip(planned, plain, strict=True):
        assert x.tokens == y.tokens and x.versions == y.versions and x.stop_reason == y.stop_reason
        if dtype == torch.bfloat16:
            assert x.logprobs == y.logprobs
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5, rel=0)
        gaps += [abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)]
    return max(gaps)


@pytest.mark.timeout(120)
@DTYPES
def test_a_batch_decoded_by_the_plan_samples_what_transformers_forward_samples(dtype):
    model = _lora_llama(dtype=dtype)
    planned, built = _run(_sampler_copy(model), plan_on=True)
    plain, none_built = _run(_sampler_copy(model), plan_on=False)
    # the slots are made at the prefill and again after each join and swap, and only then (a
    # leave renumbers them)
    assert none_built == 0 and 4 <= built <= 8
    print(f"{dtype}: largest logprob gap {_same_samples(planned, plain, dtype):.1e}")
    assert {v for r in planned for v in r.versions} == {-1, 1, 2}


@pytest.mark.timeout(60)
def test_models_the_plan_does_not_compute_keep_transformers_forward():
    from transformers import LlamaForCausalLM

    assert decode_step.plan_for(_sampler_copy(_lora_llama())) is not None
    # float16: neither oneDNN's bfloat16 layers nor plain float32 ones
    fp16 = LlamaForCausalLM(grouped_llama_config()).to(torch.float16).eval()
    fp16.set_attn_implementation("eager")
    assert decode_step.plan_for(_sampler_copy(fp16)) is None
    # sdpa attention: the plan's is eager's
    sdpa = LlamaForCausalLM(grouped_llama_config()).eval()
    sdpa.set_attn_implementation("sdpa")
    assert decode_step.plan_for(_sampler_copy(sdpa)) is None
    # biases on q/k/v (Qwen2-style)
    assert decode_step.plan_for(_sampler_copy(_lora_llama(attention_bias=True))) is None
    # a LoRA scaling that is not a power of two (alpha 6 / rank 4): pre-scaling B would round
    # (float32 scales as lora.py does, in addmm_: test_any_lora_scaling_decodes_in_float32)
    assert decode_step.plan_for(_sampler_copy(_lora_llama(alpha=6))) is None
    # LoRA dropout: not the plain case
    assert decode_step.plan_for(_sampler_copy(_lora_llama(dropout=0.1))) is None


@pytest.mark.timeout(120)
def test_any_lora_scaling_decodes_in_float32():
    model = _lora_llama(alpha=6, dtype=torch.float32)  # scaling 1.5
    fast = _sampler_copy(model)
    plan = decode_step.plan_for(fast)
    assert plan is not None
    layer = fast.model.layers[0]
    x = torch.randn(5, layer.mlp.down_proj.in_features)
    with torch.no_grad():
        plan.refresh()
        assert torch.equal(plan.blocks[0].down(x), layer.mlp.down_proj(x))
    planned, _ = _run(_sampler_copy(model), plan_on=True)
    plain, _ = _run(_sampler_copy(model), plan_on=False)
    for p, q in zip(planned, plain, strict=True):
        assert p.tokens == q.tokens and p.logprobs == pytest.approx(q.logprobs, abs=1e-5, rel=0)


@pytest.mark.timeout(120)
async def test_torch_decode_step_false_keeps_transformers_forward_and_samples_the_same():
    from headrace.core.types import SamplingParams
    from headrace.run.backends import make_backend
    from tests.torch_helpers import config

    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    got = {}
    for on in (True, False):
        async with make_backend(config(dtype="bfloat16", decode_step=on)) as backend:
            assert (backend.sampling._generator.plan is not None) is on
            prompt = backend.tokenizer.encode("12+30=")
            got[on] = await backend.sampling.sample(backend.initial_handle(), prompt, 4, params)
    assert [s.tokens for s in got[True]] == [s.tokens for s in got[False]]
    assert [s.logprobs for s in got[True]] == [s.logprobs for s in got[False]]


@pytest.mark.timeout(60)
@DTYPES
def test_every_swap_is_packed_again_even_where_the_old_storage_was_freed_first(dtype):
    """A swap frees the old version's tensors before the next are made, so the allocator may hand
    an old address out again (not seen with this torch's allocator, but allowed): the plan keys
    its packs on addresses and keeps what it packed alive, so none can pass for new weights."""
    fast = _sampler_copy(_lora_llama(targets=("o_proj",), dtype=dtype))
    plan = decode_step.plan_for(fast)
    assert plan is not None
    o_proj = fast.model.layers[0].self_attn.o_proj
    x = torch.randn(8, o_proj.in_features, dtype=dtype)
    with torch.no_grad():
        plan.refresh()
        assert torch.equal(plan.blocks[0].o(x), o_proj(x))
        for rounds in range(5):
            for name, p in fast.named_parameters():
                if "lora_" in name:
                    shape, dtype = p.shape, p.dtype
                    p.data = torch.empty(0)  # the old storage freed first, then a new one of its size
                    p.data = torch.full(shape, 0.01 * (rounds + 2), dtype=dtype)
            plan.refresh()
            assert torch.equal(plan.blocks[0].o(x), o_proj(x))


@pytest.mark.timeout(30)
def test_slots_made_from_distinct_prompts_and_a_row_index_hold_the_expanded_caches_columns():
    from types import SimpleNamespace

    torch.manual_seed(0)
    layers = [SimpleNamespace(keys=torch.randn(3, 2, 5, 4), values=torch.randn(3, 2, 5, 4)) for _ in range(2)]
    index = torch.tensor([0, 0, 2, 1, 2])
    attends = torch.ones(5, 5)
    attends[3, :2] = 0
    expanded = [SimpleNamespace(keys=layer.keys[index], values=layer.values[index]) for layer in layers]
    a = decode_step.KVSlots.of(SimpleNamespace(layers=layers), attends, 3, index)
    b = decode_step.KVSlots.of(SimpleNamespace(layers=expanded), attends, 3)
    assert a.capacity == b.capacity == 8 and a.length == b.length == 5
    for x, y in zip([*a.keys, *a.values], [*b.keys, *b.values], strict=True):
        assert x.shape == (5, 2, 8, 4) and torch.equal(x, y)  # the room's columns zero in both
    assert torch.equal(a.mask, b.mask)


def _run_ending(model: nn.Module, plan_on: bool) -> tuple[list, list[int]]:
    """Requests whose rows end at different steps (each ended row waits for its request's last),
    one cancelled while its row runs, a join after rows ended, then new adapters: every row's
    results, and the rows each decode step computed."""
    g = generate.Generator(model, 0, torch.device("cpu"))
    sizes: list[int] = []
    if plan_on:
        step = g.plan.step

        def counting(tokens, positions, slots):
            sizes.append(tokens.shape[0])
            return step(tokens, positions, slots)

        g.plan.step = counting
    else:
        g.plan = None
    with torch.no_grad():
        first = [
            generate.Member("a", _rows([[5, 6, 7, 8, 9]] * 3, [2, 9, 5], 0)),
            generate.Member("b", _rows([[11, 12]] * 2, [12, 4], 3)),
            generate.Member("c", _rows([[40, 41, 42]], [12], 5)),
        ]
        batch = generate.Generation(g, first)
        batch.advance(3)
        batch.drop([first[2]])  # nobody waits for "c" any more: it leaves running
        batch.advance(2)
        joiner = generate.Member("d", _rows([[7, 7, 7, 1]], [6], 7))
        batch.absorb(generate.Generation(g, [joiner]))
        batch.advance(2)
        _new_adapters(model, 12)
        batch.reweigh(1, "keep")
        batch.advance(None)
    return [r for m in [*first, joiner] for r in m.results()], sizes


@pytest.mark.timeout(120)
@DTYPES
def test_rows_that_end_before_their_request_leave_the_step_and_change_no_sample(dtype):
    model = _lora_llama(dtype=dtype)
    planned, sizes = _run_ending(_sampler_copy(model), plan_on=True)
    plain, _ = _run_ending(_sampler_copy(model), plan_on=False)
    # a row fewer as each ends ("a"'s first after 2 tokens, "b"'s second after 4, "a"'s third
    # after 5) and as "c" leaves; then "d" joins
    assert sizes[:6] == [6, 5, 5, 3, 2, 3]
    _same_samples(planned, plain, dtype)
    assert [len(r.tokens) for r in planned] == [2, 9, 5, 12, 4, 3, 6]


@pytest.mark.timeout(30)
def test_retired_rows_trade_slots_with_running_ones_and_settle_back_in_the_batchs_order():
    from types import SimpleNamespace

    rows = 6
    layers = [SimpleNamespace(keys=torch.arange(rows * 2.0).view(rows, 1, 2, 1), values=-torch.ones(rows, 1, 2, 1))]
    slots = decode_step.KVSlots.of(SimpleNamespace(layers=layers), torch.ones(rows, 2), 2)
    slots.retire([1, 5])
    assert slots.active == 4 and slots.running() == [0, 4, 2, 3]
    # the running rows' keys lead the buffer: slot 1 now holds row 4's
    assert slots.keys[0][1, 0, :2, 0].tolist() == [8.0, 9.0]
    slots.retire([0])
    assert slots.running() == [3, 4, 2]
    with pytest.raises(ValueError):
        slots.retire([0])  # already retired
    with pytest.raises(ValueError):
        slots.renumber([0, 1, 2, 5])  # row 3 still runs
    slots.retire([2])
    slots.renumber([0, 1, 3, 4])  # rows 2 and 5 left, the others renumbered 0-3
    assert slots.running() == [2, 3]
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=None, values=None)])
    slots.settle(cache)
    assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[0.0, 1.0], [2.0, 3.0], [6.0, 7.0], [8.0, 9.0]]
    assert cache.layers[0].values.shape == (4, 1, 2, 1)


@pytest.mark.timeout(60)
def test_the_batchs_last_rows_leaving_take_the_slots_with_them_uncopied(monkeypatch):
    # settling slots whose rows were reordered copies every layer's keys and values: when the
    # last rows leave nobody reads that copy (on SmolLM2 it was ~40 ms of a 1.3 s generation)
    settled: list[list[int | None]] = []
    settle = decode_step.KVSlots.settle

    def counting(self, cache):
        settled.append(list(self.rows))
        settle(self, cache)

    monkeypatch.setattr(decode_step.KVSlots, "settle", counting)
    g = generate.Generator(_sampler_copy(_lora_llama()), 0, torch.device("cpu"))
    member = generate.Member("a", _rows([[5, 6, 7, 8, 9]] * 3, [2, 9, 5], 0))
    batch = generate.Generation(g, [member])
    with torch.no_grad():
        batch.advance(6)
        assert batch._slots is not None and batch._slots.rows != [0, 1, 2]  # ended rows swapped back
        batch.advance(None)
    assert batch.done and batch._slots is None
    assert settled == [[0, 1, 2]]  # the prefill's, in order (views), and no other
    assert [len(r.tokens) for r in member.results()] == [2, 9, 5]
