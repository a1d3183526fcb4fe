"""The sampler's decode step, written out (``decode_step.py``) against transformers' forward, in
one process: SmolLM2-135M in bfloat16 (or float32) with LoRA 16 (random adapters), 8 prompts of
43 tokens x 8 rows x 16 tokens, one thread, rounds alternating.

    python benchmarks/decode_step_ab.py [--rounds 3] [--dtype float32] [--threads 1]
        [--change micro-kernel]

Prints each round's generation seconds and median decode-step milliseconds, then the ratios.
``--change micro-kernel`` (2026-12-06): both written out, the float32-logits head on oneDNN's
float32-on-bfloat16 matmul (the old way) against torch's micro-kernel (``brgemm.py``), e.g. at
``--threads 2``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

from headrace.backends.torch import fast_decode
from headrace.backends.torch.config import TorchConfig
from headrace.backends.torch.fast_decode import speed_up
from headrace.backends.torch.generate import Generation, Generator, Row
from headrace.backends.torch.model import load_model


def the_job(dtype: str) -> tuple[Generator, Callable[[], list[Row]]]:
    """The sampler's generator for SmolLM2-135M in ``dtype`` with LoRA 16 (random adapters) and
    the job's rows: 8 prompts of 43 tokens x 8 rows x 16 tokens, each prompt's rows seeded alike,
    made anew for each generation (also ``decode_compile_ab.py``'s)."""
    loaded = load_model("smollm2-135m", TorchConfig(dtype=dtype, lora_rank=16), torch.device("cpu"), 0)
    model = copy.deepcopy(loaded.model).eval()  # the sampler's own copy, as SamplerModel makes it
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # a trained adapter's work, not a zero one's
                p.normal_(0, 0.02)
    speed_up(model)
    gen = Generator(model.get_base_model(), 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (43,), generator=g).tolist() for _ in range(8)]

    def rows() -> list[Row]:
        return [
            Row(p, 16, 1.0, 1.0, 0, frozenset(), torch.Generator().manual_seed(i))
            for i, p in enumerate(prompts)
            for _ in range(8)
        ]

    return gen, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--change", choices=["decode-step", "micro-kernel"], default="decode-step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen, rows = the_job(args.dtype)
    plan = gen.plan
    assert plan is not None, "this model does not decode through the written-out step here"

    steps: list[float] = []
    decode = Generation._decode

    def timed(self: Generation, ids: torch.Tensor) -> None:
        start = time.perf_counter()
        decode(self, ids)
        steps.append(time.perf_counter() - start)

    Generation._decode = timed  # type: ignore[method-assign]
    new_name, old_name = ("written out", "transformers") if args.change == "decode-step" else ("micro-kernel", "oneDNN")
    results: dict[str, list[tuple[float, float]]] = {new_name: [], old_name: []}
    micro_kernel = fast_decode.micro_kernel

    def use(name: str) -> None:
        if args.change == "decode-step":
            gen.plan = plan if name == new_name else None
        else:  # the head's way alone
            old = name == old_name
            fast_decode.micro_kernel = (lambda x, weight: False) if old else micro_kernel  # type: ignore[assignment]

    with torch.no_grad():
        for name in results:  # warm-up: the packs
            use(name)
            gen.generate(rows())
        for r in range(args.rounds):
            for name in list(results) if r % 2 == 0 else list(results)[::-1]:
                use(name)
                steps.clear()
                start = time.perf_counter()
                gen.generate(rows())
                # the first step also makes the KV slots
                results[name].append((time.perf_counter() - start, statistics.median(steps[1:])))
    for name, runs in results.items():
        print(
            f"{name}: generation {', '.join(f'{a:.2f}' for a, _ in runs)} s; "
            f"decode step {', '.join(f'{b * 1e3:.1f}' for _, b in runs)} ms"
        )
    w, t = results[new_name], results[old_name]
    step_w, step_t = statistics.median(b for _, b in w), statistics.median(b for _, b in t)
    gen_w, gen_t = statistics.median(a for a, _ in w), statistics.median(a for a, _ in t)
    print(
        f"decode step {step_t * 1e3:.1f} -> {step_w * 1e3:.1f} ms ({step_t / step_w:.2f}x); "
        f"generation {gen_t:.2f} -> {gen_w:.2f} s ({gen_t / gen_w:.2f}x)"
    )


if __name__ == "__main__":
    main()
