"""Greedy held-out accuracy of SmolLM2-135M-Instruct on word_math, through headrace's own env
(MathEnv prompt + grading), renderer and batched sampler (Generator). One model load; settings
from argv as steps:max_value:format:max_tokens."""

import asyncio
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from headrace.backends.torch.generate import Generator, Row
from headrace.models.registry import model_dir
from headrace.renderers import renderer_for
from headrace.tasks import word_math
from headrace.tasks.math_envs import MathEnv

torch.set_num_threads(1)
N = int(sys.argv[1])
src = model_dir("smollm2-135m")
tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True).eval()
renderer = renderer_for("smollm2-135m", tok, "chat_template")
gen = Generator(model, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, torch.device("cpu"))


async def run(spec):
    steps, maxv, fmt, mt = spec.split(":")
    d = word_math.Difficulty(int(steps), int(maxv))
    probs = [word_math.generate(i, difficulty=d, split="test") for i in range(N)]
    envs = [MathEnv(p.question, str(p.answer), renderer, int(mt), fmt) for p in probs]
    obs = [await e.initial_observation() for e in envs]
    g = torch.Generator().manual_seed(0)
    rows = [Row(list(o), s.max_tokens, 0.0, 1.0, -1, frozenset(s.stop_token_ids), g) for o, s in obs]
    t = time.time()
    res = []
    for i in range(0, len(rows), 32):
        res += gen.generate(rows[i : i + 32])
    dt = time.time() - t
    correct = fmt_ok = stopped = 0
    lens = []
    samples = []
    for e, r, p in zip(envs, res, probs, strict=True):
        msg, clean = renderer.parse_response(r.tokens)
        v = await e.check_answer(msg["content"])
        correct += v.score
        fmt_ok += clean and e.check_format(msg["content"])
        stopped += clean
        lens.append(len(r.tokens))
        samples.append((p.question, p.answer, msg["content"], v.score))
    out = dict(
        spec=spec,
        n=N,
        acc=correct / N,
        format_ok=fmt_ok / N,
        stopped=stopped / N,
        mean_len=sum(lens) / N,
        max_len=max(lens),
        seconds=round(dt, 1),
    )
    print(json.dumps(out), flush=True)
    with open(f"/tmp/learn/probe_samples_{spec.replace(':', '_')}.json", "w") as f:
        json.dump(samples, f, indent=1)


async def main():
    for spec in sys.argv[2:]:
        await run(spec)


asyncio.run(main())
