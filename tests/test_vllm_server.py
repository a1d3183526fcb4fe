"""Server mode: the vllm sampler against vLLM's OpenAI-compatible server, started by the test on
127.0.0.1 (``--sampler-url``). Prompts go out as token id lists; token ids and logprobs come
back as numbers; each version is a LoRA adapter loaded through ``/v1/load_lora_adapter``
(full fine-tuning: a weight reload through the server's development endpoints)."""

from __future__ import annotations

import math
import socket
import time
from pathlib import Path

import pytest
from helpers import traced_train
from test_vllm_engine import LOGPROB_TOL, LORA_RANK, PROMPTS, EvenDataset, datums_for, learner_logprobs, max_gap

from headrace.core.types import AdamParams, LossSpec, SamplingParams
from headrace.run.backends import make_backend
from headrace.run.config import build_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from headrace.backends.vllm.models import save_random_llama

    return str(save_random_llama(tmp_path_factory.mktemp("model"), "tiny", seed=0, initializer_range=0.3))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """A vLLM OpenAI server on 127.0.0.1 with runtime LoRA loading and the dev endpoints on."""
    from headrace.backends.vllm.server import launch_server, server_command, server_env, stop_server

    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = server_command(
        model_dir, port=port, lora_rank=LORA_RANK, dtype="float32", max_model_len=128, enforce_eager=True,
        served_model="tiny-base",
    )  # fmt: skip
    process = launch_server(cmd, server_env(full_finetune=True), str(log))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log, timeout_s=240)
        yield url
    finally:
        stop_server(process)


def _wait_healthy(url: str, process, log: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the vLLM server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the vLLM server was not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def make_config(model_dir, url, tmp_path, **flags):
    base = {"model": model_dir, "sampler": "vllm", "steps": 2, "batch_size": 4, "group_size": 4}
    base |= {"progress": False, "run_dir": str(tmp_path / "run")}
    sets = {"torch.lora_rank": LORA_RANK, "optim.learning_rate": 0.05, "vllm.max_model_len": 128}
    sets |= {"torch.dtype": "float32"}  # float32: bfloat16 vLLM and torch kernels differ by ~2e-3 in the ratio
    sets |= {"vllm.sampler_url": f'"{url}"', "vllm.workdir": f'"{tmp_path / "versions"}"'}
    sets |= flags.pop("set", {})
    return build_config(flags=base | flags, overrides=[f"{k}={v}" for k, v in sets.items()])


def sampled_backend(config):
    """What ``headrace run --sampler vllm --sampler-url URL`` builds."""
    return make_backend(config)


@pytest.mark.timeout(400)
async def test_server_samples_match_the_learner_and_follow_published_adapters(server, model_dir, tmp_path):
    from headrace.backends.vllm.server import VllmClient

    config = make_config(model_dir, server, tmp_path)
    async with sampled_backend(config) as backend:
        assert backend.describe()["vllm_mode"] == "server" and backend.describe()["vllm_model"] == "tiny-base"
        v0 = backend.initial_handle()
        params = SamplingParams(max_tokens=12, seed=7)
        prompt = PROMPTS[0]
        samples = await backend.sampling.sample(v0, prompt, 4, params)
        assert all(s.policy_version == 0 and len(s.tokens) == len(s.logprobs) > 0 for s in samples)
        gap = max_gap(samples, await learner_logprobs(backend, prompt, samples))
        assert gap < LOGPROB_TOL, f"server and torch logprobs differ by {gap:.2e}"

        await backend.training.forward_backward(datums_for(prompt, samples, [1.0, -1.0, 1.0, -1.0]), LossSpec())
        await backend.training.optim_step(AdamParams(learning_rate=0.05))
        v1 = await backend.training.publish(1)
        after = await backend.sampling.sample(v1, prompt, 4, params)
        assert all(s.policy_version == 1 for s in after)
        assert max(abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(after, samples)) > 1e-3
        assert max_gap(after, await learner_logprobs(backend, prompt, after)) < LOGPROB_TOL
        # the server holds v1's adapter; v0's was unloaded once v1 was in
        client = VllmClient(server)
        try:
            adapters = [m["id"] for m in await client.models() if m.get("parent")]
        finally:
            await client.close()
        assert len(adapters) == 1 and adapters[0].endswith("-v1")
        # greedy with n > 1 (vLLM refuses it: asked once, repeated)
        greedy = await backend.sampling.sample(v1, prompt, 3, SamplingParams(max_tokens=6, temperature=0.0))
        assert len({tuple(s.tokens) for s in greedy}) == 1


@pytest.mark.timeout(300)
async def test_a_short_run_against_the_server_finishes(server, model_dir, tmp_path):

    config = make_config(model_dir, server, tmp_path, scheduler="async", steps=3)
    summary = await traced_train(config, dataset=EvenDataset(config.batch_size, config.group_size, config.steps))
    assert summary.steps == 3 and sum(row["groups/trained"] for row in summary.metrics) > 0
    assert all(math.isfinite(row["reward/mean"]) for row in summary.metrics)
    assert summary.backend.versions.loads >= 2


@pytest.mark.timeout(300)
async def test_full_finetune_reloads_the_server_weights(server, model_dir, tmp_path):
    config = make_config(model_dir, server, tmp_path, set={"torch.lora_rank": 0, "optim.learning_rate": 0.01})
    async with sampled_backend(config) as backend:
        v0 = backend.initial_handle()
        prompt = PROMPTS[2]
        params = SamplingParams(max_tokens=8, seed=3)
        # the server started from the same base the learner loaded: v0 needs no reload
        samples = await backend.sampling.sample(v0, prompt, 4, params)
        assert max_gap(samples, await learner_logprobs(backend, prompt, samples)) < LOGPROB_TOL
        await backend.training.forward_backward(datums_for(prompt, samples, [1.0, -1.0, 1.0, -1.0]), LossSpec())
        await backend.training.optim_step(AdamParams(learning_rate=0.01))
        v1 = await backend.training.publish(1)
        after = await backend.sampling.sample(v1, prompt, 4, params)
        assert all(s.policy_version == 1 for s in after) and backend.versions.reloads == 1
        assert max_gap(after, await learner_logprobs(backend, prompt, after)) < LOGPROB_TOL
        # put the base weights back for whoever uses the server next
        await backend.versions.target.reload_weights(model_dir)
