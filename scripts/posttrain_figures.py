"""The post-training figures of docs/post-training.md and benchmarks/RESULTS.md, end to end:
the data are generated here (nothing downloaded), every training is a `headrace` command run as a
subprocess (printed before it runs), and each figure is read back from the run's metrics.jsonl.

    python scripts/posttrain_figures.py sft_then_rl --out /tmp/ptfig      # tiny model, two seeds
    python scripts/posttrain_figures.py distill --out /tmp/ptfig          # tiny model
    python scripts/posttrain_figures.py dpo --out /tmp/ptfig              # SmolLM2-135M (LoRA)
    python scripts/posttrain_figures.py forgetting --out /tmp/ptfig       # SmolLM2-135M (LoRA)

Each prints one JSON line of figures at the end. Sizes are flags (--steps, --problems...): the
defaults are what fits a shared 2-core CPU in minutes, not what a paper would run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def headrace(*argv: str) -> float:
    """Run `headrace ARGV`; its wall time in seconds."""
    cmd = [sys.executable, "-m", "headrace", *argv]
    print("$ headrace " + " ".join(argv), file=sys.stderr, flush=True)
    started = time.perf_counter()
    # a run that ends "no update was applied" (RL on a task the model never solves) still wrote its rows
    subprocess.run(cmd, check=False, env=ENV, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def last(run: Path, suffix: str) -> float:
    return next(r[k] for r in reversed(rows(run)) for k in r if k.endswith(suffix))


def first(run: Path, suffix: str) -> float:
    return next(r[k] for r in rows(run) for k in r if k.endswith(suffix))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---- SFT then RL vs RL alone (tiny, arithmetic with two-digit sums) ----


def sums(n: int, max_operand: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
    return out


def sft_then_rl(args: argparse.Namespace) -> dict:
    out, figures = Path(args.out) / "sft_then_rl", {}
    env = ["--env", "arithmetic", "--set", f"env_options.max_operand={args.max_operand}"]
    rl = ["--batch-size", "8", "--group-size", "8", "--lr", "1e-3", "--no-progress", "--overwrite"]
    ev = ["--set", f"eval.every={args.rl_steps}", "--set", f"eval.problems={args.problems}"]
    for seed in args.seeds:
        alone = out / f"rl_alone_s{seed}"
        steps = ["--steps", str(args.rl_steps), "--seed", str(seed)]
        headrace("run", *env, *rl, *ev, *steps, "--run-dir", str(alone))
        # the time budget is the runs' own (their rows' clocks), not the processes': starting a
        # `headrace` process costs more than the tiny model's steps on a loaded machine
        budget = rows(alone)[-1]["time/total"]
        data = write_jsonl(out / f"sft_s{seed}.jsonl", sums(args.sft_examples, args.max_operand, seed))
        sft_dir = out / f"sft_s{seed}"
        headrace(
            "sft", "--data", str(data), "--renderer", "plain_text", "--run-dir", str(sft_dir), "--overwrite",
            "--steps", str(args.sft_steps), "--batch-tokens", "512", "--lr", "1e-3", "--seed", str(seed),
            "--set", "sft.epochs=100",
        )  # fmt: skip
        sft_time = rows(sft_dir)[-1]["wall_s"]
        rest = max(1, round((budget - sft_time) / (budget / args.rl_steps)))  # the same time in all
        then = out / f"sft_then_rl_s{seed}"
        ev_then = ["--set", f"eval.every={rest}", "--set", f"eval.problems={args.problems}"]
        headrace(
            "run", *env, *rl, *ev_then, "--model", str(sft_dir / "final"), "--steps", str(rest), "--seed", str(seed),
            "--run-dir", str(then), "--set", "advantages.filter_constant=false",
            # the tiny model's own defaults (a model directory gets a pretrained model's: LoRA, 256 tokens)
            "--max-tokens", "4", "--set", "torch.lora_rank=0",
        )  # fmt: skip
        figures[f"seed{seed}"] = {
            "rl_alone": {"steps": args.rl_steps, "train_s": round(budget, 1),
                         "accuracy": [first(alone, "/accuracy"), last(alone, "/accuracy")]},
            "sft_then_rl": {"sft_steps": args.sft_steps, "sft_s": round(sft_time, 1), "rl_steps": rest,
                            "train_s": round(sft_time + rows(then)[-1]["time/total"], 1),
                            "accuracy_after_sft": first(then, "/accuracy"), "accuracy": last(then, "/accuracy")},
        }  # fmt: skip
    return figures


def sft_then_rl_smollm2(args: argparse.Namespace) -> dict:
    """The same comparison on SmolLM2-135M-Instruct at a reduced scale: chat `arithmetic` with
    operands up to --max-operand. SFT (full fine-tuning: its RUN_DIR/final is a model directory
    `--model` takes) on generated worked solutions "a + b = c" to the env's own question, then
    RL (LoRA, the model directory's defaults) against RL alone from the base, the same RL steps."""
    out, figures = Path(args.out) / "sft_then_rl_smollm2", {}
    env = ["--env", "arithmetic", "--set", f"env_options.max_operand={args.max_operand}"]
    rl = ["--batch-size", "4", "--group-size", "4", "--max-tokens", "16", "--lr", "5e-4", "--no-progress"]
    rl += ["--overwrite", "--set", f"eval.every={args.rl_steps}", "--set", f"eval.problems={args.problems}"]
    rl += ["--steps", str(args.rl_steps), "--set", "torch.num_threads=1"]
    for seed in args.seeds:
        alone = out / f"rl_alone_s{seed}"
        wall_alone = headrace("run", "--model", "smollm2-135m", *env, *rl, "--seed", str(seed), "--run-dir", str(alone))
        rng = random.Random(seed)
        records = []
        for _ in range(args.sft_examples):
            a, b = rng.randint(0, args.max_operand), rng.randint(0, args.max_operand)
            question = f"What is {a}+{b}? Answer with the number only."
            records.append({"messages": [{"role": "user", "content": question},
                                         {"role": "assistant", "content": f"{a} + {b} = {a + b}"}]})  # fmt: skip
        data = write_jsonl(out / f"sft_s{seed}.jsonl", records)
        sft_dir = out / f"sft_s{seed}"
        wall_sft = headrace(
            "sft", "--model", "smollm2-135m", "--data", str(data), "--run-dir", str(sft_dir), "--overwrite",
            "--steps", str(args.sft_steps), "--batch-tokens", "1024", "--lr", "5e-5", "--seed", str(seed),
            "--set", "torch.lora_rank=0", "--set", "sft.epochs=100", "--set", "torch.num_threads=1", "--no-progress",
        )  # fmt: skip
        then = out / f"sft_then_rl_s{seed}"
        wall_then = headrace("run", "--model", str(sft_dir / "final"), *env, *rl, "--seed", str(seed),
                             "--run-dir", str(then))  # fmt: skip
        figures[f"seed{seed}"] = {
            "rl_alone": {"steps": args.rl_steps, "wall_s": round(wall_alone, 1),
                         "train_s": rows(alone)[-1]["time/total"],
                         "accuracy": [first(alone, "/accuracy"), last(alone, "/accuracy")]},
            "sft": {"steps": args.sft_steps, "wall_s": round(wall_sft, 1), "train_s": rows(sft_dir)[-1]["wall_s"],
                    "test_nll": [first(sft_dir, "test/start_nll"), last(sft_dir, "test/nll")]},
            "sft_then_rl": {"steps": args.rl_steps, "wall_s": round(wall_then, 1),
                            "train_s": rows(then)[-1]["time/total"],
                            "accuracy": [first(then, "/accuracy"), last(then, "/accuracy")]},
        }  # fmt: skip
    return figures


# ---- on-policy distillation (tiny): an RL-trained teacher, the base as the student ----


def distill(args: argparse.Namespace) -> dict:
    """The teacher: ``--teacher-run`` (a run directory, e.g. sft_then_rl's RL run), else an RL run
    made here; the student: the base tiny model, distilled on the teacher's task."""
    out = Path(args.out) / "distill"
    env = ["--env", "arithmetic", "--set", f"env_options.max_operand={args.max_operand}"]
    env += ["--batch-size", "8", "--group-size", "8", "--lr", "1e-3", "--no-progress"]
    ev = ["--set", f"eval.problems={args.problems}", "--overwrite"]
    if args.teacher_run:
        teacher, t_wall = Path(args.teacher_run), None
    else:
        teacher = out / "teacher_rl"
        t_wall = headrace("run", *env, *ev, "--steps", str(args.teacher_steps), "--set", "eval.every=10",
                          "--run-dir", str(teacher))  # fmt: skip
    student = out / "student"
    s_wall = headrace("run", *env, *ev, "--steps", str(args.student_steps), "--set", "eval.every=10",
                      "--teacher", str(teacher), "--run-dir", str(student))  # fmt: skip

    def curve(run: Path) -> list[tuple[int, float]]:
        return [(r["step"] + 1, r[k]) for r in rows(run) for k in r if k.endswith("/accuracy") and "start" not in k]

    base, t_acc, s_acc = first(student, "/accuracy"), last(teacher, "/accuracy"), last(student, "/accuracy")
    kl = [r["env/all/distill/reverse_kl"] for r in rows(student)]
    return {
        "teacher": {"run": str(teacher), "steps": len(rows(teacher)), "wall_s": t_wall, "accuracy": t_acc},
        "student": {"steps": args.student_steps, "wall_s": round(s_wall, 1), "accuracy": [base, s_acc],
                    "curve": curve(student), "reverse_kl": [kl[0], kl[-1]]},
        "share_of_teacher_gain": (s_acc - base) / (t_acc - base) if t_acc > base else None,
    }  # fmt: skip


# ---- DPO on SmolLM2-135M: pairs from the base model's own graded samples ----


def chat_question(a: int, b: int) -> str:
    return f"What is {a}+{b}? Answer with the number only."


def graded_pairs(n: int, max_operand: int, samples: int, seed: int, per_question: int = 1) -> list[dict]:
    """Sample the base model (headrace's torch backend, the run's renderer) and pair right
    answers with wrong ones of the same question (up to ``per_question`` pairs, each reply used
    once). The questions are sampled together: the torch sampler batches them."""
    import asyncio
    import re

    from headrace.core.types import SamplingParams
    from headrace.renderers import renderer_for
    from headrace.run.backends import make_backend
    from headrace.run.config import build_config
    from headrace.run.defaults import apply_model_defaults

    config = apply_model_defaults(build_config(flags={"model": "smollm2-135m", "run_dir": None}))
    rng = random.Random(seed)
    questions = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]

    async def draw() -> list[dict]:
        async with make_backend(config) as backend:
            renderer = renderer_for("smollm2-135m", backend.tokenizer)
            handle = backend.initial_handle()

            async def one(i: int, a: int, b: int) -> list[dict]:
                messages = [{"role": "user", "content": chat_question(a, b)}]
                prompt = renderer.build_generation_prompt(messages)
                params = SamplingParams(max_tokens=16, temperature=1.0, stop_token_ids=renderer.stop_token_ids,
                                        seed=seed * 100_000 + i)  # fmt: skip
                right, wrong = [], []
                for s in await backend.sampling.sample(handle, prompt, samples, params):
                    text = renderer.parse_response(s.tokens)[0]["content"].strip()
                    numbers = re.findall(r"-?\d+", text)
                    (right if numbers and int(numbers[-1]) == a + b else wrong).append(text)
                pairs = zip(right, wrong, strict=False)
                return [{"prompt": messages, "chosen": c, "rejected": r} for c, r in pairs][:per_question]

            found = await asyncio.gather(*(one(i, a, b) for i, (a, b) in enumerate(questions)))
        return [pair for pairs in found for pair in pairs]

    return asyncio.run(draw())


def dpo(args: argparse.Namespace) -> dict:
    out = Path(args.out) / "dpo"
    pairs = graded_pairs(args.questions, args.max_operand, args.samples, seed=0, per_question=args.pairs_per_question)
    data = write_jsonl(out / "pairs.jsonl", pairs)
    run = out / "run"
    wall = headrace(
        "dpo", "--model", "smollm2-135m", "--data", str(data), "--run-dir", str(run), "--overwrite",
        "--steps", str(args.steps), "--batch-tokens", str(args.batch_tokens), "--lr", str(args.lr),
        "--env", "arithmetic", "--set", f"env_options.max_operand={args.max_operand}",
        "--set", f"eval.problems={args.problems}", "--set", "dpo.test_fraction=0.25",
        "--set", f"dpo.epochs={args.epochs}", "--max-tokens", "32",
    )  # fmt: skip
    got = rows(run)
    return {
        "pairs": len(pairs), "questions": args.questions, "steps": len(got), "wall_s": round(wall, 1),
        "lr": args.lr, "epochs": args.epochs,
        "train_loss": [got[0]["dpo/loss"], got[-1]["dpo/loss"]],
        "heldout_preference_accuracy": [first(run, "test/start_accuracy"), last(run, "test/accuracy")],
        "heldout_margin": [first(run, "test/start_margin"), last(run, "test/margin")],
        "heldout_logprobs": [[first(run, "test/start_chosen_logprob"), first(run, "test/start_rejected_logprob")],
                             [last(run, "test/chosen_logprob"), last(run, "test/rejected_logprob")]],
        "task_accuracy": [first(run, "arithmetic/start_accuracy"), last(run, "arithmetic/accuracy")],
    }  # fmt: skip


# ---- SDFT vs SFT on forgetting (SmolLM2-135M): train on one task, measure another ----


def forgetting(args: argparse.Namespace) -> dict:
    """Task A (trained): "Reply in lower case: X" style chat demonstrations written here; task B
    (measured, never trained): chat arithmetic through the arithmetic env."""
    out = Path(args.out) / "forgetting"
    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon", "candle", "forest"]
    records = []
    for _ in range(args.examples):
        w = rng.sample(words, 3)
        records.append({"messages": [{"role": "user", "content": f"Spell the word '{w[0]}' backwards."},
                                     {"role": "assistant", "content": w[0][::-1]}]})  # fmt: skip
    data = write_jsonl(out / "task_a.jsonl", records)
    common = [
        "--model", "smollm2-135m", "--data", str(data), "--overwrite", "--steps", str(args.steps),
        "--batch-tokens", "1024", "--lr", "5e-4", "--env", "arithmetic", "--set", f"eval.problems={args.problems}",
    ]  # fmt: skip
    figures = {}
    for name in args.recipes:
        # sdft: the frozen teacher (the default); sdft_sync1: the teacher is the current weights at every step
        recipe = name.split("_")[0]
        run = out / name
        extra = ["--set", f"{recipe}.epochs=100"]
        if recipe == "sdft":
            extra += ["--max-tokens", "12", "--set", f"sdft.teacher_sync_every={1 if name == 'sdft_sync1' else 0}"]
        wall = headrace(recipe, *common, "--run-dir", str(run), *extra)
        figures[name] = {
            "wall_s": round(wall, 1), "steps": args.steps,
            "task_a_heldout_nll": [first(run, "test/start_nll"), last(run, "test/nll")],
            "task_b_accuracy": [first(run, "arithmetic/start_accuracy"), last(run, "arithmetic/accuracy")],
        }  # fmt: skip
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("figure", choices=["sft_then_rl", "sft_then_rl_smollm2", "distill", "dpo", "forgetting"])
    p.add_argument("--out", default="/tmp/posttrain_figures")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--problems", type=int, default=64, help="held-out problems an evaluation")
    p.add_argument("--rl-steps", type=int, default=200)
    p.add_argument("--sft-steps", type=int, default=20)
    p.add_argument("--sft-examples", type=int, default=400)
    p.add_argument("--teacher-steps", type=int, default=120)
    p.add_argument("--student-steps", type=int, default=60)
    p.add_argument("--teacher-run", help="distill: the teacher's run directory (default: an RL run made here)")
    p.add_argument("--questions", type=int, default=48)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-5, help="dpo: the learning rate")
    p.add_argument("--epochs", type=float, default=2.0, help="dpo: passes over the pairs")
    p.add_argument("--batch-tokens", type=int, default=1024, help="dpo: tokens a step (chosen + rejected)")
    p.add_argument("--pairs-per-question", type=int, default=2)
    p.add_argument("--recipes", nargs="+", default=["sft", "sdft"], choices=["sft", "sdft", "sdft_sync1"],
                   help="forgetting: which to run (sdft_sync1: the teacher re-taken from the weights every step)")
    args = p.parse_args()
    recipes = {"sft_then_rl": sft_then_rl, "sft_then_rl_smollm2": sft_then_rl_smollm2, "distill": distill}
    result = {**recipes, "dpo": dpo, "forgetting": forgetting}[args.figure](args)
    print(json.dumps({args.figure: result}))


if __name__ == "__main__":
    main()
