"""`headrace serve` in a subprocess on loopback, and the real `openai` client against it."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

TOKEN = "test-token-123"
READY = re.compile(r"serving '.*' version (\d+) at (http://127\.0\.0\.1:(\d+)/v1)")


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    run_dir: Path
    version_at_start: int
    token: str | None = TOKEN

    @property
    def client(self) -> Any:
        return openai.OpenAI(base_url=self.url, api_key=self.token or "none", max_retries=0, timeout=120)

    model: str = "tiny"
    output: list[str] = field(default_factory=list)  # what the server printed, as it prints it
    _passed: int = 0  # lines of output that wait_for_output has read

    def wait_for_output(self, fragment: str, timeout_s: float = 120) -> str:
        """The next line of the server's output that holds ``fragment`` (lines before it are passed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            while self._passed < len(self.output):
                line = self.output[self._passed]
                self._passed += 1
                if fragment in line:
                    return line
            if self.proc.poll() is not None:  # its last lines may still be on their way from the pipe
                deadline = min(deadline, time.monotonic() + 2)
            time.sleep(0.05)
        raise AssertionError(f"no line with {fragment!r} in the server's output after {timeout_s} s")

    def chat(self, content: str, scenario: str | None = None, **params: Any) -> tuple[Any, int]:
        """One completion, and the version its header reports."""
        extra = {"metadata": {"scenario": scenario}} if scenario else {}
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=[{"role": "user", "content": content}], max_tokens=params.pop("max_tokens", 6),
            extra_body=extra or None, **params,
        )  # fmt: skip
        return raw.parse(), int(raw.headers["x-headrace-version"])

    def post(self, path: str, payload: Any, token: str | None = TOKEN) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.post(self.url.removesuffix("/v1") + path, json=payload, headers=headers, timeout=60)

    def versions(self) -> list[dict[str, Any]]:
        """The chain's whole lines (a last one still being written, or torn, has no newline yet)."""
        whole = (self.run_dir / "versions.jsonl").read_text().split("\n")[:-1]
        return [json.loads(line) for line in whole]

    def versions_listing(self) -> dict[str, Any]:
        """``GET /v1/versions``: the chain as the server lists it (each loaded version's handoff)."""
        reply = httpx.get(f"{self.url}/versions", headers={"authorization": f"Bearer {self.token}"}, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def wait_for_line(self, count: int, timeout_s: float = 120) -> dict[str, Any]:
        """The chain's line ``count`` (0-based) once it is written."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = self.versions()
            if len(lines) > count:
                return lines[count]
            assert self.proc.poll() is None, f"the server exited ({self.proc.returncode})"
            time.sleep(0.1)
        raise AssertionError(f"no line {count} in versions.jsonl after {timeout_s} s: {self.versions()}")


def command(run_dir: Path, *args: str, backend: str = "torch", model: str = "tiny") -> list[str]:
    return [sys.executable, "-m", "headrace", "serve", "--backend", backend, "--model", model, "--port", "0",
            "--run-dir", str(run_dir), *args]  # fmt: skip


@contextlib.contextmanager
def serving(
    run_dir: Path,
    *args: str,
    token: str | None = TOKEN,
    backend: str = "torch",
    model: str = "tiny",
    open_files: int | None = None,
    output: list[str] | None = None,
    ready_s: float = 120,
) -> Iterator[Server]:
    """``open_files``: the server's RLIMIT_NOFILE (``ulimit -n``); ``output``: collects every line it prints."""
    env = {k: v for k, v in os.environ.items() if k != "HEADRACE_API_TOKEN"} | {"TINKER_TELEMETRY": "0"}
    if token is not None:
        env["HEADRACE_API_TOKEN"] = token
    argv = command(run_dir, *args, backend=backend, model=model)

    def limit_open_files() -> None:
        import resource

        assert open_files is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        preexec_fn=limit_open_files if open_files is not None else None,  # noqa: PLW1509 - only setrlimit
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []
    output: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            lines.put(line)
            if output is not None:
                output.append(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + ready_s
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"the server exited before it was ready:\n{''.join(seen)}")
            seen.append(line)
            if match := READY.search(line):
                break
        yield Server(proc, match[2], run_dir, int(match[1]), token, model, output)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
