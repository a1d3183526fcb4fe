"""SmolLM2-135M-Instruct on the ``code`` task's held-out problems, per family: greedy (and
optionally sampled) pass rates through headrace's own env (prompt, code extraction, sandboxed
tests), renderer and batched sampler. One model load.

    python benchmarks/code_probe.py N MAX_TOKENS FAMILY[,FAMILY...] [SAMPLES] [TURNS]

prints one JSON line per family (all-pass rate, mean pass fraction, syntax-error / no-code /
timeout rates, sandbox seconds per answer) and writes the answers to /tmp/code_probe_FAMILY.json.
FAMILY may be ``a+b+c``: one set drawn from those families together, the problems the env's own
eval draws for ``env_options.families=a,b,c``. SAMPLES > 0 adds sampled (T=1) figures and
pass@SAMPLES. TURNS > 1: greedy episodes of ``code_multi_turn`` (the test report fed back), with
the all-pass rate of the first attempt and of the last (conversations in
/tmp/code_probe_multi_FAMILY.json).
"""

import asyncio
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from headrace.backends.torch.generate import Generator, Row
from headrace.core.types import SampledTokens
from headrace.models.registry import model_dir
from headrace.renderers import renderer_for
from headrace.tasks.code_env import CodeEnv
from headrace.tasks.code_problems import generate

torch.set_num_threads(1)
N, MAX_TOKENS, FAMILIES = int(sys.argv[1]), int(sys.argv[2]), [tuple(f.split("+")) for f in sys.argv[3].split(",")]
SAMPLES = int(sys.argv[4]) if len(sys.argv) > 4 else 0
TURNS = int(sys.argv[5]) if len(sys.argv) > 5 else 1
src = model_dir("smollm2-135m")
tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True).eval()
renderer = renderer_for("smollm2-135m", tok, "chat_template")
gen = Generator(model, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, torch.device("cpu"))


async def answers(envs, temperature, repeats):
    obs = [await e.initial_observation() for e in envs]
    g = torch.Generator().manual_seed(0)
    rows = [Row(list(o), s.max_tokens, temperature, 1.0, -1, frozenset(s.stop_token_ids), g) for o, s in obs]
    rows = [r for r in rows for _ in range(repeats)]
    out = []
    for i in range(0, len(rows), 32):
        out += gen.generate(rows[i : i + 32])
    return out


async def grade(envs, results, repeats):
    figures = {"correct": 0.0, "pass_fraction": 0.0, "syntax_error": 0.0, "no_code": 0.0, "timeout": 0.0}
    seconds, samples, solved = 0.0, [], set()
    for i, r in enumerate(results):
        env = envs[i // repeats]
        msg, clean = renderer.parse_response(r.tokens)
        graded = await env.grade(msg["content"])
        figures["correct"] += graded.passed == graded.total
        if graded.passed == graded.total:
            solved.add(i // repeats)
        figures["pass_fraction"] += graded.fraction
        figures["syntax_error"] += graded.syntax_error is not None
        figures["no_code"] += graded.no_code
        figures["timeout"] += graded.timed_out
        seconds += graded.seconds
        samples.append((env.problem.says, msg["content"], graded.fraction))
    n = len(results)
    out = {k: round(v / n, 3) for k, v in figures.items()} | {"sandbox_ms": round(1000 * seconds / n, 1)}
    return out | {f"pass@{repeats}": round(len(solved) / len(envs), 3)}, samples


async def multi_turn(family):
    problems = [generate(i, split="test", families=family) for i in range(N)]
    envs = [CodeEnv(p, renderer, MAX_TOKENS, turns=TURNS) for p in problems]
    g = torch.Generator().manual_seed(0)
    pending = {i: (await e.initial_observation()) for i, e in enumerate(envs)}
    final = {}
    while pending:
        order = list(pending)
        rows = [Row(list(pending[i][0]), pending[i][1].max_tokens, 0.0, 1.0, -1,
                    frozenset(pending[i][1].stop_token_ids), g) for i in order]  # fmt: skip
        results = []
        for k in range(0, len(rows), 32):
            results += gen.generate(rows[k : k + 32])
        for i, r in zip(order, results, strict=True):
            step = await envs[i].step(SampledTokens(r.tokens, r.logprobs, r.stop_reason))
            if step.done:
                final[i] = step.metrics
                del pending[i]
            else:
                pending[i] = (step.next_observation, step.next_stop)
    first = sum(m["first_pass_fraction"] == 1.0 for m in final.values()) / N
    last = sum(m["correct"] for m in final.values()) / N
    fixed = sum(m["fixed"] for m in final.values())
    failed_first = sum(m["first_pass_fraction"] < 1.0 for m in final.values())
    attempts = sum(m["attempts"] for m in final.values()) / N
    line = {"family": "+".join(family), "n": N, "turns": TURNS, "first_attempt_all_pass": round(first, 3)}
    line |= {"last_attempt_all_pass": round(last, 3), "fixed": f"{fixed:g} of {failed_first}", "attempts": attempts}
    print(json.dumps(line), flush=True)
    with open(f"/tmp/code_probe_multi_{'+'.join(family)}.json", "w") as f:
        json.dump([e.messages for e in envs], f, indent=1)


async def main():
    if TURNS > 1:
        for family in FAMILIES:
            await multi_turn(family)
        return
    for family in FAMILIES:
        problems = [generate(i, split="test", families=family) for i in range(N)]
        envs = [CodeEnv(p, renderer, MAX_TOKENS) for p in problems]
        t = time.time()
        greedy = await answers(envs, 0.0, 1)
        sampling_s = time.time() - t
        out, samples = await grade(envs, greedy, 1)
        line = {"family": "+".join(family), "n": N, "max_tokens": MAX_TOKENS, "greedy": out}
        line["seconds"] = round(sampling_s, 1)
        if SAMPLES:
            sampled, _ = await grade(envs, await answers(envs, 1.0, SAMPLES), SAMPLES)
            line["sampled_T1"] = sampled
        print(json.dumps(line), flush=True)
        with open(f"/tmp/code_probe_{'+'.join(family)}.json", "w") as f:
            json.dump(samples, f, indent=1)


asyncio.run(main())
