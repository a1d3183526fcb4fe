"""Where does a bfloat16 SmolLM2 differ from the float32 one? The mean |logprob gap| to float32 on
sampled tokens with the model in bfloat16 whole, and with only the linear layers' inputs, weights
and outputs in bfloat16 (norms, residual adds, rotary, attention in float32).

Why: ``bf16_update_check.py`` puts the bfloat16 learner's mean gap to the float32 one at 0.02-0.07
a token on the learning job's batches; this says which part of the model to keep in float32 if
that gap is to shrink (the sampler would have to do the same, or its logprobs stop agreeing).

    python benchmarks/bf16_gap_sources.py [--batches 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
from collections.abc import Callable
from typing import Any

import torch
from bf16_update_check import _config, sample_group  # benchmarks/ is the script's own folder
from torch import nn
from torch.nn import functional as F


async def _sequences(batches: int, seed: int) -> tuple[Any, list[tuple[list[int], int]]]:
    """(the float32 backend's model, [(prompt + sampled tokens, prompt length)])."""
    from headrace.run.backends import make_backend
    from headrace.run.train import make_dataset

    config = _config("float32", seed)
    out = []
    async with make_backend(config) as backend:
        dataset = make_dataset(config, backend)
        handle = backend.initial_handle()
        for b in range(batches):
            for i, builder in enumerate(dataset.get_batch(b)):
                prompt, samples, _ = await sample_group(config, backend, handle, builder, b * 1000 + i)
                out.extend((prompt + list(x.tokens), len(prompt)) for x in samples if x.tokens)
    from transformers import AutoModelForCausalLM  # the plain model: no LoRA layers, the head as shipped

    from headrace.backends.torch.model import model_dir

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir("smollm2-135m")), dtype=torch.float32, local_files_only=True, attn_implementation="eager"
    )
    return model, out


def _logprobs(model: nn.Module, head: Callable[[torch.Tensor], torch.Tensor], seq: list[int], n: int) -> torch.Tensor:
    ids = torch.tensor([seq])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        logits = head(hidden[n - 1 : -1]).float()
    return logits.log_softmax(-1).gather(1, ids[0, n:, None])[:, 0]


class _Bf16Linear(nn.Module):
    """A float32 linear layer computed as bfloat16: input and weight rounded, output rounded and
    handed on in float32."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.weight = layer.weight.detach().bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.bfloat16(), self.weight).float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    model32, seqs = asyncio.run(_sequences(args.batches, args.seed))
    model32.eval()
    w = model32.lm_head.weight.detach()
    model16 = copy.deepcopy(model32).bfloat16()
    mixed = copy.deepcopy(model32)
    for module in list(mixed.model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, _Bf16Linear(child))
    w16 = w.bfloat16().float()

    def head32(h: torch.Tensor) -> torch.Tensor:
        return h @ w.T

    def head16(h: torch.Tensor) -> torch.Tensor:  # float32 sums of bfloat16 products: the tree's head
        return h.bfloat16().float() @ w16.T

    variants = {
        "bfloat16 whole (float32 logits)": (model16, head16),
        "bfloat16 linears only": (mixed, head16),
        "float32 body, bfloat16 head": (model32, head16),
    }
    ref = [_logprobs(model32, head32, s, n) for s, n in seqs]
    tokens = sum(len(r) for r in ref)
    print(f"{len(seqs)} sequences, {tokens} sampled tokens")
    for label, (model, head) in variants.items():
        gaps = torch.cat([(_logprobs(model, head, s, n) - r).abs() for (s, n), r in zip(seqs, ref, strict=True)])
        print(
            f"{label:>34}: mean |gap| {gaps.mean():.4f}, median {gaps.median():.4f}, max {gaps.max():.3f}", flush=True
        )


if __name__ == "__main__":
    main()
