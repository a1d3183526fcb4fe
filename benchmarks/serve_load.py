"""Request load on ``headrace serve`` while it learns: requests/s and p50/p99 latency at several
levels of concurrent clients, with candidates trained and published behind the requests.

Starts ``headrace serve`` (tiny model unless ``--model``; torch backend; ``--port 0``; its own run
directory in a temp directory; a random token) as a subprocess. For each level (``--levels``,
default 1 8 32 concurrent clients) the clients send chats for ``--duration`` seconds, each a new
request as soon as its last is answered (closed loop), while a feedback poster scores every
answer (``--reward random``: uniform in [0, 1]; ``share``: the share of ``a`` in the answer),
in lists of what came in since its last post, so the server trains a candidate every
``--batch-size`` scored answers of its incumbent and publishes it (gate "always"). Per level:
requests/s (answers / the level's wall time), p50/p99/max latency of a chat (send to parsed
answer, as the client sees it), completion tokens/s, and the versions published during it (the
``/healthz`` version before and after, and the distinct versions that answered).

    .venv/bin/python benchmarks/serve_load.py                     # 1 8 32 clients, 20 s each
    .venv/bin/python benchmarks/serve_load.py --levels 1 8 32 64 --duration 30 --client httpx

Prints a markdown table and writes benchmarks/out/serve_load.json (or ``--out``). The clients run
in this process: on a small machine they take CPU from the server (the figures say what a
client on the same machine sees, not the server alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

PROMPTS = ("say a", "write aaa", "hi! how are you?", "what is 2+3?", "tell me a word", "ok.")
READY = re.compile(r"headrace serve: serving .* at (http://\S+/v1)")


class Server:
    """``headrace serve`` in a subprocess, its output in a file; stopped with SIGTERM."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.token = secrets.token_hex(16)
        self.run_dir = workdir / "run"
        self.log = workdir / "server.out"
        cmd = [sys.executable, "-m", "headrace", "serve", "--backend", "torch", "--model", args.model]
        cmd += ["--port", "0", "--run-dir", str(self.run_dir), "--batch-size", str(args.batch_size)]
        if args.max_tokens is not None:
            cmd += ["--max-tokens", str(args.max_tokens)]
        for item in args.set:
            cmd += ["--set", item]
        self.cmd = cmd
        env = {**os.environ, "HEADRACE_API_TOKEN": self.token}
        self._out = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env)
        self.url = ""

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (m := READY.search(self.log.read_text())) is not None:
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"headrace serve did not start ({' '.join(self.cmd)}):\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        return self.proc.returncode

    def versions(self) -> list[dict[str, Any]]:
        path = self.run_dir / "versions.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def reward_of(text: str, kind: str, rng: random.Random) -> float:
    if kind == "random":
        return rng.random()
    return text.count("a") / len(text) if text else 0.0


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in [0, 100]) of an ascending list."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


class Load:
    """One level: ``clients`` closed-loop clients for ``duration`` seconds, and the feedback poster."""

    def __init__(self, args: argparse.Namespace, server: Server, clients: int):
        self.args, self.server, self.clients = args, server, clients
        self.latencies: list[float] = []
        self.tokens = 0
        self.versions: dict[int, int] = {}
        self.errors: dict[str, int] = {}
        self.pending: list[dict[str, Any]] = []
        self.scored = self.feedback_posts = 0
        self.rng = random.Random(args.seed + clients)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    async def chat(self, client: Any, prompt: str) -> tuple[str, str, int, int]:
        """(id, text, version, completion tokens) of one chat."""
        messages = [{"role": "user", "content": prompt}]
        if self.args.client == "openai":
            c = await client.chat.completions.create(model=self.args.model, messages=messages)
            version = (c.model_extra or {}).get("policy_version", -1)
            return c.id, c.choices[0].message.content or "", version, c.usage.completion_tokens if c.usage else 0
        r = await client.post("/chat/completions", json={"model": self.args.model, "messages": messages})
        if r.status_code != 200:
            raise httpx.HTTPStatusError(f"{r.status_code}", request=r.request, response=r)
        body = r.json()
        text = body["choices"][0]["message"]["content"] or ""
        return body["id"], text, body["policy_version"], body["usage"]["completion_tokens"]

    async def client_loop(self, client: Any, worker: int, end: float) -> None:
        rng = random.Random(self.args.seed * 1000 + worker)
        while time.monotonic() < end:
            prompt = rng.choice(PROMPTS)
            started = time.monotonic()
            try:
                cid, text, version, tokens = await self.chat(client, prompt)
            except (openai.APIError, httpx.HTTPError) as e:
                self.error(type(e).__name__)
                await asyncio.sleep(0.05)
                continue
            self.latencies.append(time.monotonic() - started)
            self.tokens += tokens
            self.versions[version] = self.versions.get(version, 0) + 1
            self.pending.append({"id": cid, "reward": reward_of(text, self.args.reward, self.rng)})

    async def poster(self, http: httpx.AsyncClient, done: asyncio.Event) -> None:
        """Posts what came in since the last post, every 20 ms, and what is left once the clients stop."""
        while True:
            finished = done.is_set()
            if self.pending and self.args.feedback:
                items, self.pending = self.pending, []
                try:
                    r = await http.post("/feedback", json=items)
                    if r.status_code == 200:
                        self.scored += len(items)
                    else:
                        self.error(f"feedback {r.status_code}")
                except httpx.HTTPError as e:
                    self.error(f"feedback {type(e).__name__}")
                self.feedback_posts += 1
            if finished:
                return
            try:
                await asyncio.wait_for(done.wait(), 0.02)
            except TimeoutError:
                pass

    async def run(self, http: httpx.AsyncClient, client: Any) -> dict[str, Any]:
        before = (await http.get(self.server.url.removesuffix("/v1") + "/healthz")).json()["version"]
        lines_before = len(self.server.versions())
        started = time.monotonic()
        end = started + self.args.duration
        done = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:  # the poster ends with the clients, or is cancelled if one fails
            tasks.create_task(self.poster(http, done))
            try:
                await asyncio.gather(*(self.client_loop(client, i, end) for i in range(self.clients)))
            finally:
                wall = time.monotonic() - started
                done.set()
        await asyncio.sleep(0.2)  # a candidate whose batch the last post completed
        after = (await http.get(self.server.url.removesuffix("/v1") + "/healthz")).json()["version"]
        new_lines = self.server.versions()[lines_before:]
        lat = sorted(self.latencies)
        n = len(lat)
        cand = [e["metrics"].get("time/candidate", 0.0) for e in new_lines if "metrics" in e]
        return {
            "clients": self.clients,
            "duration_s": round(wall, 2),
            "requests": n,
            "requests_per_s": n / wall,
            "completion_tokens_per_s": self.tokens / wall,
            "completion_tokens_mean": self.tokens / n if n else 0.0,
            "latency_p50_ms": percentile(lat, 50) * 1000,
            "latency_p99_ms": percentile(lat, 99) * 1000,
            "latency_max_ms": lat[-1] * 1000 if lat else float("nan"),
            "version_before": before,
            "version_after": after,
            "published": after - before,
            "chain_lines": {o: sum(e["outcome"] == o for e in new_lines) for o in {e["outcome"] for e in new_lines}},
            "candidate_s_mean": sum(cand) / len(cand) if cand else None,
            "versions_that_answered": len(self.versions),
            "scored": self.scored,
            "feedback_posts": self.feedback_posts,
            "errors": self.errors,
        }


async def measure(args: argparse.Namespace, server: Server) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {server.token}"}
    limits = httpx.Limits(max_connections=max(args.levels) + 8, max_keepalive_connections=max(args.levels) + 8)
    timeout = httpx.Timeout(300.0)
    async with (
        httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits, timeout=timeout) as http,
        httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits, timeout=timeout) as chat_http,
    ):
        if args.client == "openai":
            client: Any = openai.AsyncOpenAI(
                base_url=server.url, api_key=server.token, http_client=chat_http, max_retries=0
            )
        else:
            client = chat_http
        if args.warmup > 0:  # first requests build the sampler's caches; not measured, not scored
            warm = Load(args, server, min(args.levels))
            end = time.monotonic() + args.warmup
            await asyncio.gather(*(warm.client_loop(client, i, end) for i in range(max(args.levels))))
        results = []
        for clients in args.levels:
            result = await Load(args, server, clients).run(http, client)
            results.append(result)
            print(
                f"{clients:>3} clients: {result['requests_per_s']:.1f} req/s, p50 {result['latency_p50_ms']:.0f} ms, "
                f"p99 {result['latency_p99_ms']:.0f} ms, {result['published']} versions published",
                flush=True,
            )
        return results


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| clients | requests | req/s | p50 ms | p99 ms | max ms | completion tok/s | versions published | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['clients']} | {r['requests']} | {r['requests_per_s']:.1f} | {r['latency_p50_ms']:.0f} "
            f"| {r['latency_p99_ms']:.0f} | {r['latency_max_ms']:.0f} | {r['completion_tokens_per_s']:.0f} "
            f"| {r['published']} | {sum(r['errors'].values())} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients, one level each")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of unmeasured, unscored requests first")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8, help="serve.batch_size: scored answers per candidate")
    p.add_argument("--max-tokens", type=int, help="the server's default max_tokens (default: the model's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to headrace serve")
    p.add_argument("--reward", choices=["random", "share"], default="random")
    p.add_argument("--no-feedback", dest="feedback", action="store_false",
                   help="score nothing: no candidate trains (the control)")  # fmt: skip
    p.add_argument("--client", choices=["openai", "httpx"], default="openai", help="what sends the chats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--out", default="benchmarks/out/serve_load.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        server = Server(args, Path(tmp))
        t0 = time.monotonic()
        try:
            url = server.wait_ready(args.start_timeout)
            print(f"server at {url} after {time.monotonic() - t0:.1f} s: {' '.join(server.cmd[1:])}", flush=True)
            results = asyncio.run(measure(args, server))
            chain = server.versions()
        finally:
            rc = server.stop()
    print(table(results))
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "server": " ".join(server.cmd[1:]),
        "server_exit": rc,
        "args": vars(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "levels": results,
        "chain_outcomes": {o: sum(e["outcome"] == o for e in chain) for o in {e["outcome"] for e in chain}},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
