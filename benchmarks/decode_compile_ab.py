"""The sampler's written-out decode step (``decode_step.py``) against the same step with each
layer's elementwise work compiled by ``torch.compile`` (an experiment, not in the backend), in one
process: SmolLM2-135M in bfloat16 with LoRA 16 (random adapters), 8 prompts of 43 tokens x 8 rows
x 16 tokens, one thread, generations alternating.

    python benchmarks/decode_compile_ab.py [--rounds 4]

One graph serves all 30 layers and every step: the layer is compiled with ``dynamic=True`` and
``fullgraph=True``, the KV column passed as a tensor (a Python int specialises: a recompile per
step), each oneDNN group an opaque ``torch.library.custom_op`` (inductor cannot lower a prepacked
linear). Prints the first (compiling) generation's seconds, how many of the 64 seeded rows draw
the same tokens both ways and the logprob gap where they agree, then each way's generation
seconds and the ratio. Measured: benchmarks/RESULTS.md, 2026-12-07.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from decode_step_ab import the_job
from torch import Tensor

from headrace.backends.torch import decode_step as ds
from headrace.backends.torch.generate import RowResult

GROUPS: list[Any] = []  # the plan's groups, four a layer, by the index the custom op takes


@torch.library.custom_op("headrace_bench::group", mutates_args=())
def group(x: Tensor, key: int, out: int) -> Tensor:
    return GROUPS[key](x)


@group.register_fake
def _(x: Tensor, key: int, out: int) -> Tensor:
    return x.new_empty(x.shape[0], out)


def layer(x, keys, values, col, mask, cos, signed_sin, norm1, eps1, norm2, eps2, first, outs, heads, kv, dim, scaling):
    """``DecodePlan.step``'s body for one layer, the KV write as ``index_copy_`` at ``col``."""
    rows, groups = x.shape[0], heads // kv
    qkv = group(ds._rms(x, norm1, eps1), first, outs[0])
    qk = ds._rotate(qkv[:, : (heads + kv) * dim].view(rows, heads + kv, dim), cos, signed_sin)
    keys.index_copy_(2, col, qk[:, heads:, None])
    values.index_copy_(2, col, qkv[:, (heads + kv) * dim :].view(rows, kv, 1, dim))
    q = qk[:, :heads].reshape(rows, kv, groups, dim)
    weights = torch.add(mask, torch.matmul(q, keys.transpose(2, 3)), alpha=scaling)
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(x.dtype)
    x = x + group(torch.matmul(weights, values).view(rows, heads * dim), first + 1, outs[1])
    gate_up = group(ds._rms(x, norm2, eps2), first + 2, outs[2])
    half = gate_up.shape[1] // 2
    return x + group(F.silu(gate_up[:, :half]) * gate_up[:, half:], first + 3, outs[3])


def compiled_step(plan: ds.DecodePlan, compiled: Any):
    """``DecodePlan.step`` with each layer through ``compiled``."""
    outs = []  # each layer's four output widths, for the custom op's fake
    for block in plan.blocks:
        groups = [block.qkv, block.o, block.gate_up, block.down]
        GROUPS.extend(groups)
        outs.append([sum(g.sizes) for g in groups])
    assert plan.exact_scaling, "the compiled layer adds the mask and the scaled scores in one call"

    @torch.no_grad()
    def step(self: ds.DecodePlan, tokens: Tensor, positions: Tensor, slots: Any) -> Tensor:
        col, rows = slots.length, tokens.shape[0]
        self.refresh()
        slots.mask[:rows, col] = 0.0
        mask = slots.mask[:rows, None, None, :]
        x = self.embed(tokens)
        heads, kv, dim = self.heads, self.kv, self.dim
        cos, sin = self.rotary(x, positions)
        cos = cos.view(rows, 1, dim)
        signed_sin = torch.cat([-sin[..., : dim // 2], sin[..., dim // 2 :]], -1).view(rows, 1, dim)
        at = torch.tensor([col])
        for i, (block, keys, values) in enumerate(zip(self.blocks, slots.keys, slots.values, strict=True)):
            x = compiled(
                x, keys[:rows], values[:rows], at, mask, cos, signed_sin, *block.norm1, *block.norm2,
                4 * i, outs[i], heads, kv, dim, self.scaling,
            )  # fmt: skip
        slots.length = col + 1
        return self.head(ds._rms(x, *self.norm)).float()

    return step


def agreeing_gaps(a: list[RowResult], b: list[RowResult]) -> list[float]:
    """Per row, the logprob gaps of the tokens both ways drew alike, up to where they part."""
    gaps: list[float] = []
    for x, y in zip(a, b, strict=True):
        for p, q, lp, lq in zip(x.tokens, y.tokens, x.logprobs, y.logprobs, strict=False):
            if p != q:
                break
            gaps.append(abs(lp - lq))
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    inductor_config.emulate_precision_casts = True
    gen, rows = the_job("bfloat16")
    assert gen.plan is not None, "this model does not decode through the written-out step here"
    eager = ds.DecodePlan.step
    ways = {"eager": eager, "compiled": compiled_step(gen.plan, torch.compile(layer, dynamic=True, fullgraph=True))}

    def generate(name: str) -> tuple[float, list[RowResult]]:
        ds.DecodePlan.step = ways[name]  # type: ignore[method-assign]
        start = time.perf_counter()
        with torch.no_grad():
            out = gen.generate(rows())
        return time.perf_counter() - start, out

    try:
        _, before = generate("eager")
        first, _ = generate("compiled")
        _, compiled = generate("compiled")
        _, after = generate("eager")
        gaps = agreeing_gaps(before, compiled)
        alike = sum(x.tokens == y.tokens for x, y in zip(before, compiled, strict=True))
        unchanged = all(x.tokens == y.tokens for x, y in zip(before, after, strict=True))
        print(f"first compiled generation {first:.1f} s (compiling)")
        print(
            f"rows drawn alike: {alike} of {len(before)}; logprob gap over {len(gaps)} agreeing tokens: "
            f"max {max(gaps):.3g}, mean {statistics.mean(gaps):.3g}; eager after compiling draws as before: {unchanged}"
        )
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for r in range(args.rounds):
            for name in list(times) if r % 2 == 0 else list(times)[::-1]:
                times[name].append(generate(name)[0])
    finally:
        ds.DecodePlan.step = eager  # type: ignore[method-assign]
    for name, runs in times.items():
        print(f"{name}: generation {', '.join(f'{t:.2f}' for t in runs)} s")
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    print(f"generation {e:.2f} -> {c:.2f} s ({e / c:.2f}x)")


if __name__ == "__main__":
    main()
