"""The torch sampler's in-flight weight swap: keep the KV cache (PipelineRL) or recompute it?

For each mode, one batch (``--rows`` rows of one prompt, shared prefill) is sampled with version 0
and version 1 is swapped in after exactly ``--swap-at`` decode steps; version 1 is one optimizer
step of ``--lr`` away. Reported: the swap's time (``TorchSampler.swaps``) beside one decode step's,
and the mean |sampler - learner| logprob of the post-swap tokens, the learner being the trainer's
forward under version 1 (what decoupled PPO / TIS compare against); ``version gap``: how far the
two versions' logprobs are apart on the same tokens (the size of the update), ``floor``: the same
gap for a batch sampled with version 1 throughout (float round-off alone).

    .venv/bin/python benchmarks/inflight_swap_torch.py --model tiny
    .venv/bin/python benchmarks/inflight_swap_torch.py --model smollm2-135m --rows 8 --swap-at 16 --max-tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import torch

from headrace.backends.torch.config import TorchConfig
from headrace.core.types import AdamParams, Datum, LossSpec, SampledTokens, SamplingParams
from headrace.run.backends import make_backend
from headrace.run.config import RunConfig


def datum(prompt: list[int], s: SampledTokens, advantage: float = 1.0) -> Datum:
    seq, n = prompt + s.tokens, len(prompt) - 1
    mask = [0.0] * n + [1.0] * len(s.tokens)
    return Datum(seq[:-1], seq[1:], [0.0] * n + list(s.logprobs), [advantage * m for m in mask], mask)


def prompt_of(backend, model: str) -> list[int]:
    if model == "tiny":
        return backend.tokenizer.encode("12+30=")
    hf = backend.tokenizer.hf
    messages = [{"role": "user", "content": "What is 12+30? Explain step by step."}]
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


async def sample_with_swap(backend, prompt, rows, params, new_handle, swap_at):
    sampler = backend.sampling
    sampler.slice_steps = swap_at
    sampler._live = None  # start again from version 0 (swaps only ever move forward)
    sampler.swap_weights(backend.initial_handle())
    task = asyncio.ensure_future(sampler.sample(backend.initial_handle(), prompt, rows, params))
    await asyncio.sleep(0)
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(600)

    backend._device_thread.submit_threadsafe(hold)
    await asyncio.to_thread(entered.wait, 600)
    sampler.swap_weights(new_handle)
    release.set()
    return await task


def plain_logprobs(backend, weights, prompt, tokens) -> list[float]:
    model = backend.sampling._model
    model.use(weights)
    with torch.no_grad():
        logits = model.forward_module(input_ids=torch.tensor([prompt + tokens], device=backend.device)).logits[0]
    lps = logits.float().log_softmax(-1)[len(prompt) - 1 : -1]
    return lps.gather(-1, torch.tensor(tokens, device=backend.device)[:, None]).squeeze(-1).tolist()


async def measure(args) -> None:
    torch_cfg = TorchConfig(device=args.device, num_threads=args.threads, sample_batch_wait_s=0.0)
    async with make_backend(RunConfig(model=args.model, seed=0, torch=torch_cfg)) as backend:
        prompt = prompt_of(backend, args.model)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=7)
        v0 = backend.initial_handle()
        # version 1: one step on group-relative advantages of version 0's own samples
        samples = await backend.sampling.sample(v0, prompt, args.rows, params)
        datums = [datum(prompt, s, 1.0 if i % 2 else -1.0) for i, s in enumerate(samples)]
        await backend.training.forward_backward(datums, LossSpec("importance_sampling"))
        await backend.training.optim_step(AdamParams(learning_rate=args.lr))
        v1 = await backend.training.publish(1)
        begun = time.perf_counter()
        plain = await backend.sampling.sample(v1, prompt, args.rows, params)
        step_s = (time.perf_counter() - begun) / max(len(s.tokens) for s in plain)
        print(f"model {args.model}  rows {args.rows}  prompt {len(prompt)} tokens  swap at step {args.swap_at}")
        print(f"  one decode step (with prefill share): {step_s * 1e3:.1f} ms")
        floor = await gaps(backend, prompt, plain, None, 0)
        print(f"  floor (sampled with v1 throughout): mean |sampler - learner| {floor[0]:.2e}")
        for mode in ("recompute", "keep"):
            backend.sampling.swap_mode = mode
            backend.sampling.swaps.clear()
            out = await sample_with_swap(backend, prompt, args.rows, params, v1, args.swap_at)
            post, moved = await gaps(backend, prompt, out, v0, args.swap_at)
            swap_s = statistics.mean(s[3] for s in backend.sampling.swaps)
            tokens = sum(max(0, len(s.tokens) - args.swap_at) for s in out)
            print(
                f"  {mode:9s}: swap {swap_s * 1e3:.1f} ms ({swap_s / step_s:.1f} steps)"
                f"  post-swap |sampler - learner| mean {post:.2e} over {tokens} tokens  (version gap {moved:.2e})"
            )


async def gaps(backend, prompt, samples, v0, swap_at) -> tuple[float, float]:
    datums = [datum(prompt, s) for s in samples]
    result = await backend.training.forward_backward(datums, LossSpec("importance_sampling"))
    backend.training.optimizer.zero_grad(set_to_none=True)
    post, moved = [], []
    for s, lps in zip(samples, result.logprobs_D, strict=True):
        learner = lps[-len(s.tokens) :] if s.tokens else []
        old = learner
        if v0 is not None:
            old = await backend._device_thread.submit(plain_logprobs, backend, v0.ref, prompt, s.tokens)
        for j in range(swap_at, len(s.tokens)):
            post.append(abs(s.logprobs[j] - learner[j]))
            moved.append(abs(old[j] - learner[j]))
    return statistics.mean(post), statistics.mean(moved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--swap-at", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=None, help="default: the model's own learning rate")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.lr is None:
        from headrace.models import model_spec

        args.lr = model_spec(args.model).learning_rate
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
