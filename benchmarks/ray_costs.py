"""What one message of ``--cluster ray`` costs the driver, and what a publish costs: the figures
behind the model in RESULTS.md ("Ray: scale and per-message costs").

    .venv/bin/python benchmarks/ray_costs.py                       # all three parts
    .venv/bin/python benchmarks/ray_costs.py --parts publish --sizes-mb 1,16,128,512,2048

On a local Ray instance (``headrace.backends.ray.runtime.ensure_ray("local")``, the machine's CPUs):

- ``sample``: requests through the real ``ReplicaRouter`` to ``SamplerReplica`` actors on the
  sim backend with zero latency (the replica does nothing but draw 4 tokens), at concurrency 1
  (the round trip) and 256 (throughput); driver CPU per request from ``time.process_time``.
- ``env``: env calls through ``RemoteEnv`` (``WorkerPool.call``) to a ``RolloutWorker`` holding
  the ``arithmetic`` env behind ``faulty`` with ``busy_ms = 0``: episodes of ``initial_observation``
  + ``step``, at concurrency 1 and 256; per call. ``ping`` (a bare sync actor call) for reference.
- ``publish``: a dict of float32 numpy arrays (4 MB each, the last smaller) ``ray.put`` by the
  driver (as a learner rank's return of ``weights_of`` puts it), then loaded by 1 and 2 trivial
  actors given the ref as an argument (as ``ReplicaRouter.load_all`` does): ``map`` reads one
  value per 4 KB page of Ray's zero-copy view, ``copy`` copies every array (what
  ``torch.tensor(array)`` in ``TorchBackend.handle_for`` does). The real ``handle_for`` (CPU,
  float32) is timed apart, in this process, on the same arrays.

Every figure is the median of ``--repeats`` (3). The machine is shared: read the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from headrace.backends.ray.replicas import ReplicaRouter, SamplerReplica
from headrace.backends.ray.runtime import ensure_ray, import_ray
from headrace.backends.ray.workers import RemoteGroupBuilder, RolloutWorker, WorkerPool
from headrace.bench.scenario import load_scenario
from headrace.core.protocols import InnerBackend
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, StopReason
from headrace.run.backends import context
from headrace.run.train import make_dataset

MB = 1 << 20


def zero_latency_config(tmp: str) -> Any:
    overrides = {
        "sim": {"sample_request_s": 0.0, "sample_token_s": 0.0, "sample_concurrency": 100_000},
        "env_options": {"env": "arithmetic", "busy_ms": 0.0},
    }
    return load_scenario("cpu_heavy_env").config("async", tmp, overrides)


async def closed_loop(call: Any, total: int, concurrency: int) -> dict[str, float]:
    """``total`` calls from ``concurrency`` clients, each awaiting its call before the next."""
    per, rest = divmod(total, concurrency)

    async def client(k: int) -> None:
        for _ in range(k):
            await call()

    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client(per + (i < rest)) for i in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"per_s": total / wall, "driver_cpu_us": cpu / total * 1e6, "latency_ms": wall / per * 1e3}


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = statistics.median(values)
        out[key + "_range"] = (min(values), max(values))
    return out


async def measure_sample(ray: Any, config: Any, repeats: int, total: int) -> list[dict[str, Any]]:
    rows = []
    training = InnerBackend(config.backend, config.section(config.backend).model_dump())
    ctx = dataclasses.replace(context(config), run_dir=None)
    for n_replicas in (1, 2):
        cls = ray.remote(SamplerReplica).options(max_concurrency=1000)
        actors = [cls.remote(training, None, ctx, i, 3) for i in range(n_replicas)]
        facts = await asyncio.gather(*(a.start.remote() for a in actors))
        router = ReplicaRouter(actors, facts[0]["max_context"], 3)
        handle, prompt, params = SamplerHandle(0), [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=8)

        async def call(router=router, handle=handle, prompt=prompt, params=params) -> None:
            await router.sample(handle, prompt, 1, params)

        await closed_loop(call, 500, 64)  # warm-up
        for concurrency in (1, 256):
            n = total // 5 if concurrency == 1 else total
            s = summary([await closed_loop(call, n, concurrency) for _ in range(repeats)])
            rows.append({"part": "sample", "replicas": n_replicas, "concurrency": concurrency, **s})
            print_row(rows[-1])
        for a in actors:
            ray.kill(a)
    return rows


async def measure_env(ray: Any, config: Any, repeats: int, total: int) -> list[dict[str, Any]]:
    from headrace.tokenizers.char import CharTokenizer

    rows = []
    dataset = make_dataset(config, SimpleNamespace(tokenizer=CharTokenizer()))
    actor = ray.remote(RolloutWorker).options(max_concurrency=config.section("ray").episodes_per_worker).remote(0)
    await actor.ping.remote()
    pool = WorkerPool([actor])
    envs = []
    for b in dataset.get_batch(0):  # 16 groups of 8: 128 envs on the worker
        envs += await RemoteGroupBuilder(b, pool).make_envs()
    action = SampledTokens([ord("7"), 0], [-1.0, -1.0], StopReason.STOP, 0)
    cursor = iter(range(1 << 62))

    async def episode_call() -> None:  # one call; alternately the episode's first and its step
        k = next(cursor)
        env = envs[(k // 2) % len(envs)]
        if k % 2 == 0:
            await env.initial_observation()
        else:
            await env.step(action)

    async def ping() -> None:
        await actor.ping.remote()

    await closed_loop(episode_call, 1000, 64)  # warm-up
    for name, call in (("env call", episode_call), ("ping", ping)):
        for concurrency in (1, 256):
            n = total // 5 if concurrency == 1 else total
            s = summary([await closed_loop(call, n, concurrency) for _ in range(repeats)])
            rows.append({"part": name, "replicas": 1, "concurrency": concurrency, **s})
            print_row(rows[-1])
    ray.kill(actor)
    return rows


class Loader:
    """A torch-free stand-in for a sampler replica's ``load``."""

    def load(self, weights: dict[str, np.ndarray], mode: str) -> float:
        started = time.perf_counter()
        if mode == "copy":
            self.held = {k: np.array(a, copy=True) for k, a in weights.items()}
        else:  # map: one value per 4 KB page of the zero-copy view
            self.held = sum(float(a.reshape(-1)[::1024].sum()) for a in weights.values())
        return time.perf_counter() - started

    def drop(self) -> None:
        self.held = None


def make_weights(size_mb: int) -> dict[str, np.ndarray]:
    weights, left, i = {}, size_mb * MB, 0
    while left > 0:
        n = min(left, 4 * MB)
        weights[f"layer{i}.weight"] = np.full(n // 4, 0.5, dtype=np.float32)
        left, i = left - n, i + 1
    return weights


def torch_handle_for_s(weights: dict[str, np.ndarray]) -> float:
    """``TorchBackend.handle_for`` itself (CPU, float32), on a stand-in ``self``."""
    from headrace.backends.torch.backend import TorchBackend

    fake = SimpleNamespace(device="cpu", _published=lambda version, tensors: tensors)
    arrays = {k: (a, "") for k, a in weights.items()}
    started = time.perf_counter()
    handle = TorchBackend.handle_for(fake, 1, arrays)
    seconds = time.perf_counter() - started
    del handle
    return seconds


async def measure_publish(ray: Any, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    loaders = [ray.remote(Loader).remote() for _ in range(2)]
    await asyncio.gather(*(a.drop.remote() for a in loaders))
    for size in sizes:
        weights = make_weights(size)
        gb = size * MB / 1e9
        for n in (1, 2):
            for mode in ("map", "copy"):
                runs = []
                for _ in range(repeats):
                    await asyncio.gather(*(a.drop.remote() for a in loaders))
                    gc.collect()
                    cpu, t0 = time.process_time(), time.perf_counter()
                    ref = ray.put(weights)
                    t1 = time.perf_counter()
                    put_cpu = time.process_time() - cpu
                    inner = await asyncio.gather(*(a.load.remote(ref, mode) for a in loaders[:n]))
                    t2 = time.perf_counter()
                    runs.append(
                        {
                            "put_s": t1 - t0,
                            "put_driver_cpu_s": put_cpu,
                            "load_s": t2 - t1,
                            "load_in_actor_s": max(inner),
                            "publish_s": t2 - t0,
                            "load_driver_cpu_s": time.process_time() - cpu - put_cpu,
                        }
                    )
                    del ref
                s = summary(runs)
                s["put_gb_per_s"] = gb / s["put_s"]
                s["publish_gb_per_s"] = gb / s["publish_s"]
                rows.append({"part": "publish", "size_mb": size, "replicas": n, "mode": mode, **s})
                print_row(rows[-1])
        torch_s = statistics.median(torch_handle_for_s(weights) for _ in range(repeats))
        rows.append({"part": "torch handle_for", "size_mb": size, "s": torch_s, "gb_per_s": gb / torch_s})
        print_row(rows[-1])
        del weights
        gc.collect()
    for a in loaders:
        ray.kill(a)
    return rows


def print_row(row: dict[str, Any]) -> None:
    shown = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("_range")}
    print(json.dumps(shown), flush=True)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    ray = import_ray()
    started = ensure_ray("local")
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ray-costs-") as tmp:
            config = zero_latency_config(tmp)
            if "sample" in args.parts:
                rows += await measure_sample(ray, config, args.repeats, args.calls)
            if "env" in args.parts:
                rows += await measure_env(ray, config, args.repeats, args.calls)
            if "publish" in args.parts:
                rows += await measure_publish(ray, [int(s) for s in args.sizes_mb.split(",")], args.repeats)
    finally:
        if started:
            ray.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="sample,env,publish")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=10_000, help="calls per measurement at concurrency 256")
    parser.add_argument("--sizes-mb", default="1,16,128,512")
    parser.add_argument("--out", help="write the rows here (JSON)")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
