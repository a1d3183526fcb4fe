"""A scripted user of ``headrace serve``: it chats, scores every answer, and watches the served
model learn from that feedback, version by version.

Each request is a short chat (one of a few prompts, varied a little, sent with the scenario tag
``share``); the answer's reward is the share of one character (``--char``, default ``a``) in its
text (an empty answer scores 0), posted to ``POST /v1/feedback``. Every answer is recorded with
the version that served it (``policy_version``), and at the end a table gives, per version, the
answers it served and their mean reward: with a learning server the reward rises from about
1/40 (random characters) as versions are published.

Start a server (the tiny model, from scratch, on a CPU), then the user against it::

    export HEADRACE_API_TOKEN=secret
    headrace serve --backend torch --model tiny --port 8000 --run-dir /tmp/serve-demo --overwrite \\
        --batch-size 8 --max-tokens 16
    python examples/serve_scripted_user.py --url http://127.0.0.1:8000/v1 --minutes 2 --out /tmp/user.jsonl

What it printed here (2-core CPU, shared; trimmed; learning rate the tiny model's 3e-4)::

    | version | answers | mean reward |
    | 0-6 | 183 | 0.234 |
    | 7-13 | 177 | 0.767 |
    | 28-34 | 236 | 0.945 |
    | 175-181 | 229 | 1.000 |
    5712 answers from 185 versions in 120.4 s (47.5 answers/s)
    mean reward: versions 0-2 0.063, versions 182-184 0.997

(version 0 served 0.019, version 4 0.33 at 2.3 s, version 23 0.9 at 17 s: answers of 16 a's.)

It works against any server that speaks the same routes, started by whoever; ``--versions N``
stops once N versions past the one serving at the start have answered. The OpenAI client sends
the chats; httpx posts the feedback (the OpenAI client has no such route).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

# Prompts inside the tiny model's alphabet (lower case, digits, ``+-*/=?<>!., :;()``); {c} is the char.
PROMPTS = ("say {c}", "write {c}{c}{c}", "more {c} please", "hi! {c}?", "only {c}, ok?", "{c} {c} {c}")


def reward_of(text: str, char: str) -> float:
    """The share of ``char`` among the answer's characters; an empty answer scores 0."""
    return text.count(char) / len(text) if text else 0.0


def make_prompt(rng: random.Random, char: str) -> str:
    """One of a few prompts, now and then with a number after it (so prompts vary a little)."""
    prompt = rng.choice(PROMPTS).format(c=char)
    return f"{prompt} {rng.randint(1, 9)}" if rng.random() < 0.25 else prompt


@dataclass
class Tally:
    """What the user saw: answers and rewards per serving version, errors, the time it took."""

    rewards: dict[int, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    feedback_refused: int = 0
    started: float = field(default_factory=time.monotonic)
    first_version: int | None = None

    def add(self, version: int, reward: float) -> None:
        self.rewards.setdefault(version, []).append(reward)
        if self.first_version is None:
            self.first_version = version

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    @property
    def answers(self) -> int:
        return sum(map(len, self.rewards.values()))

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"version": v, "answers": len(r), "mean_reward": sum(r) / len(r)} for v, r in sorted(self.rewards.items())
        ]


def table(rows: list[dict[str, Any]], max_rows: int = 30) -> str:
    """A markdown table of (version, answers, mean reward); more versions than ``max_rows`` are
    shown in runs of consecutive versions (answers summed, rewards averaged over answers)."""
    size = max(1, math.ceil(len(rows) / max_rows))
    lines = ["| version | answers | mean reward |", "|---:|---:|---:|"]
    for i in range(0, len(rows), size):
        chunk = rows[i : i + size]
        n = sum(r["answers"] for r in chunk)
        mean = sum(r["answers"] * r["mean_reward"] for r in chunk) / n
        first, last = chunk[0]["version"], chunk[-1]["version"]
        label = str(first) if first == last else f"{first}-{last}"
        lines.append(f"| {label} | {n} | {mean:.3f} |")
    return "\n".join(lines)


async def user(
    worker: int,
    args: argparse.Namespace,
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    model: str,
    tally: Tally,
    stop: asyncio.Event,
    out: Any,
) -> None:
    rng = random.Random(args.seed * 1000 + worker)
    extra: dict[str, Any] = {}
    if args.max_tokens is not None:
        extra["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    while not stop.is_set():
        prompt = make_prompt(rng, args.char)
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                extra_headers={"x-headrace-scenario": args.scenario},
                **extra,
            )
        except openai.AuthenticationError as e:
            raise SystemExit(f"the server refused the token (${args.token_env}): {e}") from None
        except openai.APIStatusError as e:
            tally.error(f"chat {e.status_code}")
            await asyncio.sleep(0.2)
            continue
        except openai.APIConnectionError:
            tally.error("chat connection")
            await asyncio.sleep(0.5)
            continue
        completion = raw.parse()
        extra_fields = completion.model_extra or {}
        version = extra_fields.get("policy_version")
        if version is None:  # a server that sends the header only
            version = int(raw.headers.get("x-headrace-version", -1))
        text = completion.choices[0].message.content or ""
        reward = reward_of(text, args.char)
        try:
            reply = await http.post("/feedback", json={"id": completion.id, "reward": reward})
            if reply.status_code != 200:
                tally.feedback_refused += 1
                tally.error(f"feedback {reply.status_code}")
        except httpx.HTTPError:
            tally.error("feedback connection")
        tally.add(version, reward)
        if out is not None:
            record = {"t": round(time.monotonic() - tally.started, 3), "version": version, "prompt": prompt}
            out.write(json.dumps({**record, "answer": text, "reward": reward, "id": completion.id}) + "\n")
        assert tally.first_version is not None
        if args.versions is not None and version >= tally.first_version + args.versions:
            stop.set()


async def progress(tally: Tally, stop: asyncio.Event, every: float) -> None:
    """A line every ``every`` seconds: answers so far, the newest version and its mean reward."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass
        if tally.rewards:
            newest = max(tally.rewards)
            r = tally.rewards[newest]
            print(
                f"[{time.monotonic() - tally.started:6.1f}s] {tally.answers} answers; version {newest}: "
                f"{len(r)} answers, mean reward {sum(r) / len(r):.3f}",
                flush=True,
            )


async def run(args: argparse.Namespace) -> Tally:
    token = os.environ.get(args.token_env, "").strip() or "none"
    base = args.url.rstrip("/")
    tally = Tally()
    stop = asyncio.Event()
    timeout = httpx.Timeout(120.0)
    async with (
        openai.AsyncOpenAI(base_url=base, api_key=token, timeout=120.0, max_retries=2) as client,
        httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=timeout) as http,
    ):
        model = args.model or (await client.models.list()).data[0].id
        with open(args.out, "w") if args.out else _Null() as out:
            deadline = args.minutes * 60 if args.minutes is not None else None
            # the users and the progress line stop when `stop` is set (N versions reached, or the deadline);
            # a user that fails cancels the rest, and its error is raised
            async with asyncio.TaskGroup() as tasks:
                for i in range(args.concurrency):
                    tasks.create_task(user(i, args, client, http, model, tally, stop, out if args.out else None))
                tasks.create_task(progress(tally, stop, args.progress_every))
                with contextlib.suppress(TimeoutError):  # the deadline: each user finishes its chat in flight
                    await asyncio.wait_for(stop.wait(), deadline)
                stop.set()
    return tally


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 base URL")
    p.add_argument("--token-env", default="HEADRACE_API_TOKEN", help="the environment variable holding the token")
    p.add_argument("--model", help="the model to ask for (default: the first /v1/models lists)")
    until = p.add_mutually_exclusive_group()
    until.add_argument("--minutes", type=float, help="stop after this long (default 3 when --versions is not given)")
    until.add_argument("--versions", type=int, help="stop once N versions past the first one seen have answered")
    p.add_argument("--concurrency", type=int, default=8, help="chats in flight at once")
    p.add_argument("--char", default="a", help="the character whose share of the answer is its reward")
    p.add_argument("--scenario", default="share", help="the scenario tag sent with every chat")
    p.add_argument("--max-tokens", type=int, help="max_tokens of each chat (default: the server's)")
    p.add_argument("--temperature", type=float, help="temperature of each chat (default: the server's)")
    p.add_argument("--out", help="write every answer (time, version, prompt, answer, reward) to this JSONL file")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' choice")
    p.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    args = p.parse_args(argv)
    if len(args.char) != 1:
        p.error(f"--char must be one character, got {args.char!r}")
    if args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    if args.minutes is None and args.versions is None:
        args.minutes = 3.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tally = asyncio.run(run(args))
    rows = tally.rows()
    wall = time.monotonic() - tally.started
    print(table(rows))
    print(f"{tally.answers} answers from {len(rows)} versions in {wall:.1f} s ({tally.answers / wall:.1f} answers/s)")
    if len(rows) >= 2:
        k = max(1, min(3, len(rows) // 3))

        def mean_of(chunk: list[dict[str, Any]]) -> float:
            return sum(r["answers"] * r["mean_reward"] for r in chunk) / sum(r["answers"] for r in chunk)

        first = f"{rows[0]['version']}-{rows[k - 1]['version']}"
        last = f"{rows[-k]['version']}-{rows[-1]['version']}"
        print(f"mean reward: versions {first} {mean_of(rows[:k]):.3f}, versions {last} {mean_of(rows[-k:]):.3f}")
    if tally.errors:
        print("errors: " + ", ".join(f"{k} x{n}" for k, n in sorted(tally.errors.items())), file=sys.stderr)
    if args.out:
        print(f"answers written to {Path(args.out)}")
    return 0 if tally.answers else 1


if __name__ == "__main__":
    sys.exit(main())
