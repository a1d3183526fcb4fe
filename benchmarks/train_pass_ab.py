"""The learner's bfloat16 changes of 2026-12-02 evening off and on, alternating in one process:
CPU seconds (``time.process_time``, one thread) of forward_backward + optim_step over synthetic
datums of issue 24's shape (8 prompts of 43 tokens x 8 answers of 3-16, loss on the answers),
SmolLM2-135M, LoRA 16. "old": transformers' RMSNorm, PEFT's LoRA forward, a float32 log-softmax
over the vocabulary, a KV cache built in the pass; "new": this tree.
``--change layers`` (2026-12-02 night): "old" is transformers' Llama attention and MLP classes and
the float32-logits head's former arithmetic (a negated copy, two upcasts), "new" this tree's
``layers.py`` and head.
``--change float32-head`` (2026-12-03, a CPU without bfloat16 units): the model in float32, "old"
its head's logprobs through log_softmax, "new" through the chunked logsumexp (``scoring.py``).
``--change micro-kernel`` (2026-12-04, a CPU with bfloat16 units): "old" the float32-logits head
as one oneDNN matmul of float32 copies, "new" torch's bfloat16 micro-kernel (``brgemm.py``).

    python benchmarks/train_pass_ab.py [--rounds 3] [--change evening|layers|float32-head|micro-kernel]
        [--threads 1]

CPU seconds rather than wall seconds: on a machine shared with other jobs they move far less.
``--threads N`` above 1 times wall seconds instead (idle torch threads spin, which CPU seconds
count as work): ``--change micro-kernel --threads 2`` (2026-12-06) is the micro-kernel's column
blocks shared among two threads against oneDNN's threaded matmul.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from headrace.backends.torch import scoring
from headrace.backends.torch.config import TorchConfig
from headrace.backends.torch.model import load_model, trainable_parameters
from headrace.backends.torch.trainer import TorchTrainer
from headrace.core.types import AdamParams, Datum, LossSpec


def datums(seed: int = 0) -> list[Datum]:
    rng = random.Random(seed)
    out = []
    for _ in range(8):
        prompt = [rng.randrange(100, 40000) for _ in range(43)]
        for s in range(8):
            n = rng.choice([3, 8, 16, 16, 16])
            seq = prompt + [rng.randrange(100, 40000) for _ in range(n)]
            k = len(prompt) - 1
            mask = [0.0] * k + [1.0] * n
            adv = 1.0 if s % 2 else -1.0
            out.append(Datum(seq[:-1], seq[1:], [0.0] * k + [-2.0] * n, [adv * m for m in mask], mask))
    return out


def old_head(head, hidden, target):
    return head(hidden).float().log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)


LEARNER_CLASSES = ("LearnerAttention", "LearnerMLP")


def old_logits(x, weight):
    rounded = x @ weight.t()
    return rounded.float().add_(torch.addmm(rounded.neg(), x, weight.t()).float())


def main() -> None:
    from peft.tuners.lora import Linear
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from headrace.backends.torch.lora import FusedLoraLinear
    from headrace.backends.torch.norms import RMSNorm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--change", choices=["evening", "layers", "float32-head", "micro-kernel"], default="evening")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock, unit = (time.process_time, "CPU s") if args.threads == 1 else (time.perf_counter, "s")
    dtype = "float32" if args.change == "float32-head" else "bfloat16"
    loaded = load_model(args.model, TorchConfig(dtype=dtype, lora_rank=16), torch.device("cpu"), 0)
    model = loaded.model
    model.eval()
    trainer = TorchTrainer(
        model,
        trainable_parameters(model),
        None,  # type: ignore[arg-type]  # called directly, no device thread
        torch.device("cpu"),
        loaded.pad_token_id,
        AdamParams(),
        Path("/tmp/headrace-train-pass-ab"),
        publisher=lambda v, t: None,  # type: ignore[arg-type,return-value]
    )
    loras = [m for m in model.modules() if isinstance(m, Linear)]
    norms = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                old = LlamaRMSNorm(child.weight.shape[0], eps=child.variance_epsilon)
                old.weight = child.weight
                norms.append((parent, name, old, child))
    body, new_head = trainer.scorer.body, scoring._head_logprobs
    forward = body.forward

    def with_cache(*a, **k):
        return forward(*a, **{**k, "use_cache": True})

    from headrace.backends.torch import head as head_module

    switched = [(m, type(m), type(m).__mro__[1]) for m in model.modules() if type(m).__name__ in LEARNER_CLASSES]
    new_logits = head_module.float32_logits

    def use_layers(old: bool) -> None:
        for m, new_class, old_class in switched:
            m.__class__ = old_class if old else new_class
        # scoring imported the name: both modules' references switch
        head_module.float32_logits = old_logits if old else new_logits  # type: ignore[assignment]
        scoring.float32_logits = old_logits if old else new_logits  # type: ignore[assignment]

    def use_evening(old: bool) -> None:
        for m in loras:
            m.__class__ = Linear if old else FusedLoraLinear
        for parent, name, before, after in norms:
            setattr(parent, name, before if old else after)
        scoring._head_logprobs = old_head if old else new_head  # type: ignore[assignment]
        body.forward = with_cache if old else forward

    wide = scoring._wide_float32

    def use_float32_head(old: bool) -> None:
        scoring._wide_float32 = (lambda head: False) if old else wide  # type: ignore[assignment]

    micro_kernel = head_module.micro_kernel

    def use_micro_kernel(old: bool) -> None:
        head_module.micro_kernel = (lambda x, weight: False) if old else micro_kernel  # type: ignore[assignment]

    use = {
        "layers": use_layers,
        "evening": use_evening,
        "float32-head": use_float32_head,
        "micro-kernel": use_micro_kernel,
    }[args.change]
    ds = datums()

    def step() -> float:
        start = clock()
        trainer._forward_backward(ds, LossSpec("importance_sampling"))
        trainer._step(AdamParams(learning_rate=1e-5))
        return clock() - start

    step()  # warm-up
    seconds: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in seconds:
            use(name == "old")
            seconds[name].append(step())
            print(f"round {r} {name}: {seconds[name][-1]:.2f} {unit}", flush=True)
    best = {k: min(v) for k, v in seconds.items()}
    median = {k: sorted(v)[len(v) // 2] for k, v in seconds.items()}
    print(
        f"old {best['old']:.2f} / {median['old']:.2f}, new {best['new']:.2f} / {median['new']:.2f} {unit} "
        f"(min / median): "
        f"{best['old'] / best['new']:.2f}x / {median['old'] / median['new']:.2f}x"
    )


if __name__ == "__main__":
    main()
