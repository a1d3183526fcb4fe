"""``headrace serve`` under load and under attack at once: legitimate closed-loop clients (with
feedback, so candidates train and publish) while idle and slow connections are held open and
malformed requests keep arriving. Says whether every legitimate request was answered, their
p50/p99 latency, the server's RSS over the run, what the server counted, and whether it was still
up at the end.

The attackers, each re-opening what the server cuts:

- ``--idle N`` connections that connect and say nothing;
- ``--slow N`` slowloris connections: a request line, then one header byte every second;
- ``--malformed N`` senders of a malformed request every ``--malformed-every`` seconds each, in
  turn: every kind h11 refuses (``tests/http_probe.py``'s list), a HEAD, JSON nested 100k deep,
  a 400-digit reward, a reward of 1e308, a seed of 2**64;
- ``--big-bodies N`` requests at a time declaring a 31 MB body without a token, which then send
  the body as fast as the server takes it.

    .venv/bin/python benchmarks/serve_attack.py        # 128 clients, 20 s, 200 idle + 100 slow, 4 + 4 senders
    .venv/bin/python benchmarks/serve_attack.py --idle 0 --slow 0 --malformed 0 --big-bodies 0   # the control

Writes benchmarks/out/serve_attack.json (or ``--out``). The clients and the attackers run in this
process, beside the server on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from serve_load import Load, Server, percentile  # noqa: E402

from tests.http_probe import DEEP_JSON, MALFORMED  # noqa: E402


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Attack:
    def __init__(self, args: argparse.Namespace, port: int, token: str):
        self.args, self.port, self.token = args, port, token
        self.counts: Counter[str] = Counter()  # what the attackers saw: connections cut, statuses
        self.statuses: Counter[str] = Counter()

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def idle(self, end: float) -> None:
        """Connect, say nothing; when the server hangs up, connect again."""
        while time.monotonic() < end:
            try:
                reader, writer = await self._open()
            except OSError:
                self.counts["idle_connect_failed"] += 1
                await asyncio.sleep(0.5)
                continue
            self.counts["idle_opened"] += 1
            try:
                await asyncio.wait_for(reader.read(), max(0.0, end - time.monotonic()))
                self.counts["idle_cut"] += 1
            except (TimeoutError, OSError):
                pass
            writer.close()

    async def slow(self, end: float) -> None:
        """A request line, then a header byte a second, never silent for long; reopened when cut."""
        while time.monotonic() < end:
            try:
                reader, writer = await self._open()
                writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: ")
                self.counts["slow_opened"] += 1
                while time.monotonic() < end:
                    try:
                        await asyncio.wait_for(reader.read(65536), 1.0)  # the server hung up (or answered)
                        self.counts["slow_cut"] += 1
                        break
                    except TimeoutError:
                        writer.write(b"a")
                        await writer.drain()
                writer.close()
            except OSError:
                self.counts["slow_connect_failed"] += 1
                await asyncio.sleep(0.5)

    def _cases(self) -> list[tuple[str, list[bytes]]]:
        auth = f"authorization: Bearer {self.token}\r\n".encode()

        def post(path: str, body: bytes) -> bytes:
            head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\nconnection: close\r\n"
            return head.encode() + auth + b"\r\n" + body

        chat = b'{"messages": [{"role": "user", "content": "x"}], "seed": ' + str(2**64).encode() + b"}"
        # the probes' own token header is the tests'; this server's replaces it
        theirs = b"authorization: Bearer test-token-123\r\n"
        cases = [(what, [p.replace(theirs, auth) for p in parts]) for what, parts, _, _ in MALFORMED]
        return [
            *cases,
            ("HEAD", [b"HEAD /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"]),
            ("deep JSON", [post("/v1/chat/completions", DEEP_JSON)]),
            ("400-digit reward", [post("/v1/feedback", b'{"id": "x", "reward": ' + b"9" * 400 + b"}")]),
            ("reward 1e308", [post("/v1/feedback", b'{"id": "x", "reward": 1e308}')]),
            ("seed 2**64", [post("/v1/chat/completions", chat)]),
        ]

    async def malformed(self, end: float, first: int) -> None:
        cases = [(what, parts) for what, parts in self._cases() if what not in self.args.skip]
        i = first
        while time.monotonic() < end:
            what, parts = cases[i % len(cases)]
            i += 1
            try:
                reader, writer = await self._open()
                for k, part in enumerate(parts):
                    if k:  # a head over 64 KiB: in two writes, so that the server holds an incomplete one
                        await writer.drain()
                        await asyncio.sleep(0.3)
                    writer.write(part)
                if what.startswith("a body cut short"):
                    writer.write_eof()
                reply = await asyncio.wait_for(reader.read(200), 10)
                status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/1.1 ") else "closed"
                self.statuses[f"{what}: {status}"] += 1
                writer.close()
            except (OSError, TimeoutError) as e:
                self.statuses[f"{what}: {type(e).__name__}"] += 1
            await asyncio.sleep(self.args.malformed_every)

    async def big_body(self, end: float) -> None:
        """31 MB declared, no token: the answer should come before the body is read."""
        chunk = b"x" * 2**20
        while time.monotonic() < end:
            try:
                reader, writer = await self._open()
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 31000000\r\n\r\n")
                sent = 0
                read = asyncio.ensure_future(reader.read(200))
                try:
                    while sent < 31_000_000 and not read.done():
                        writer.write(chunk)
                        await writer.drain()
                        sent += len(chunk)
                except OSError:
                    pass  # the server closed on us while we sent: its answer may still be there
                reply = await asyncio.wait_for(read, 30)
                status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/1.1 ") else "closed"
                self.statuses[f"big body {status}"] += 1
                writer.close()
            except (OSError, TimeoutError) as e:
                self.statuses[f"big body {type(e).__name__}"] += 1
                await asyncio.sleep(0.2)


async def measure(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    headers = {"Authorization": f"Bearer {server.token}"}
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    timeout = httpx.Timeout(120.0)
    attack = Attack(args, port, server.token)
    rss: list[tuple[float, float]] = []

    async def watch(end: float) -> None:
        while time.monotonic() < end and server.proc.poll() is None:
            if (mib := rss_mib(server.proc.pid)) is not None:
                rss.append((time.monotonic(), mib))
            await asyncio.sleep(0.5)

    async with (
        httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits, timeout=timeout) as http,
        httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits, timeout=timeout) as chat_http,
    ):
        warm_end = time.monotonic() + args.warmup
        warm = Load(args, server, args.clients)
        await asyncio.gather(*(warm.client_loop(chat_http, i, warm_end) for i in range(args.clients)))
        rss_before = rss_mib(server.proc.pid)
        end = time.monotonic() + 1.0 + args.duration  # the attack begins 1 s before the measured load
        attackers = [attack.idle(end) for _ in range(args.idle)] + [attack.slow(end) for _ in range(args.slow)]
        attackers += [attack.malformed(end, 7 * i) for i in range(args.malformed)]
        attackers += [attack.big_body(end) for _ in range(args.big_bodies)]
        async with asyncio.TaskGroup() as tasks:
            for a in attackers:
                tasks.create_task(a)
            tasks.create_task(watch(end))
            await asyncio.sleep(1.0)  # the attackers are in place before the legitimate clients start
            load = Load(args, server, args.clients)
            started = time.monotonic()
            try:
                result: dict[str, Any] = await load.run(http, chat_http)
            except httpx.HTTPError as e:  # the server died: its /healthz no longer answers
                result = {"published": None, "server_gone": f"{type(e).__name__}: {e}"}
            wall = time.monotonic() - started
        health = None
        if server.proc.poll() is None:
            health = (await http.get(server.url.removesuffix("/v1") + "/healthz")).json()
    lat = sorted(load.latencies)
    mibs = [m for _, m in rss]
    return {
        "legitimate": {
            "clients": args.clients,
            "answered": len(lat),
            "failed": load.errors,
            "requests_per_s": len(lat) / wall,
            "latency_p50_ms": percentile(lat, 50) * 1000,
            "latency_p99_ms": percentile(lat, 99) * 1000,
            "latency_max_ms": lat[-1] * 1000 if lat else None,
            "published": result["published"],
            "scored": load.scored,
            **({"server_gone": result["server_gone"]} if "server_gone" in result else {}),
        },
        "attack": {
            "idle": args.idle,
            "slow": args.slow,
            "big_bodies": args.big_bodies,
            "seen": dict(attack.counts),
            "malformed_answers": dict(attack.statuses),
        },
        "rss_mib": {
            "after_warmup": rss_before,
            "min": min(mibs) if mibs else None,
            "max": max(mibs) if mibs else None,
            "end": mibs[-1] if mibs else None,
            "samples": [round(m, 1) for m in mibs],
        },
        "server_counts": health.get("http") if health else None,  # (no counts before issue 22)
        "server_up_at_end": server.proc.poll() is None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=128, help="legitimate closed-loop clients")
    p.add_argument("--duration", type=float, default=20.0, help="seconds under attack")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of unmeasured, unscored requests first")
    p.add_argument("--idle", type=int, default=200, help="silent connections held open")
    p.add_argument("--slow", type=int, default=100, help="slowloris connections")
    p.add_argument("--malformed", type=int, default=4, help="senders of malformed requests, each in turn")
    p.add_argument("--malformed-every", type=float, default=0.05, help="seconds between one sender's requests")
    p.add_argument("--skip", nargs="+", default=[], metavar="WHAT", help="malformed requests not sent (e.g. HEAD)")
    p.add_argument("--big-bodies", type=int, default=4, help="unauthenticated 31 MB bodies in flight at once")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8, help="serve.batch_size: scored answers per candidate")
    p.add_argument("--max-tokens", type=int, help="the server's default max_tokens (default: the model's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to headrace serve")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--out", default="benchmarks/out/serve_attack.json")
    args = p.parse_args(argv)
    # what serve_load's Load reads
    args.reward, args.feedback, args.client, args.levels = "random", True, "httpx", [args.clients]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="serve_attack_") as tmp:
        server = Server(args, Path(tmp))
        try:
            url = server.wait_ready(args.start_timeout)
            print(f"server at {url}: {' '.join(server.cmd[1:])}", flush=True)
            out = asyncio.run(measure(args, server))
            log_tail = server.log.read_text()[-2000:]
        finally:
            rc = server.stop()
    legit, rss = out["legitimate"], out["rss_mib"]
    print(
        f"{legit['clients']} clients for {args.duration:.0f} s beside {args.idle} idle + {args.slow} slow connections, "
        f"{args.malformed} senders of malformed requests and {args.big_bodies} unauthenticated 31 MB bodies:\n"
        f"  legitimate: {legit['answered']} answered, failed {legit['failed'] or 'none'}, "
        f"p50 {legit['latency_p50_ms']:.0f} ms, p99 {legit['latency_p99_ms']:.0f} ms, {legit['published']} published\n"
        f"  RSS MiB: {rss['after_warmup']} after warm-up, {rss['min']}-{rss['max']} during, {rss['end']} at the end\n"
        f"  attackers saw: {out['attack']['seen']}; answers: {out['attack']['malformed_answers']}\n"
        f"  server counted: {out['server_counts']}; up at the end: {out['server_up_at_end']} (exit {rc} on SIGTERM)"
    )
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "server": " ".join(server.cmd[1:]),
        "server_exit": rc,
        "args": {k: v for k, v in vars(args).items() if k not in ("levels",)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        **out,
        "server_output_tail": log_tail,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
