"""`headrace serve --sampler vllm`: the torch trainer forks candidates, vLLM serves the incumbent
(a published candidate's weights reach vLLM before it answers)."""

from __future__ import annotations

import json

import pytest

from tests.serve_support import serving

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_smoke_with_vllm_sampling(tmp_path):
    flags = ["--sampler", "vllm", "--batch-size", "4", "--set", "vllm.gpu_memory_utilization=0.2"]
    flags += ["--set", "torch.dtype=float32"]  # bfloat16 vLLM and torch kernels differ by ~2e-3 in the ratio
    # vLLM's CPU engine takes minutes to start on a loaded machine
    with serving(tmp_path / "d", *flags, ready_s=600) as server:
        ids = [server.chat(f"hello {i}", scenario="smoke")[0].id for i in range(4)]
        assert server.post("/v1/feedback", [{"id": c, "reward": float(r)} for r, c in enumerate(ids)]).is_success
        assert server.wait_for_line(1, timeout_s=300)["outcome"] == "published"
        completion, version = server.chat("next")
        assert version == 1 and completion.model_extra["policy_version"] == 1


def log_events(run_dir, event: str) -> list[dict]:
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(str.strip, lines)) if r.get("event") == event]


@pytest.mark.timeout(1500)
def test_a_rejected_candidate_loads_nothing_into_vllm(tmp_path):
    """The gate judges a candidate on the learner's own sampler: one it rejects is never saved or
    loaded as a vLLM adapter, and the incumbent's adapter stays loaded (not pushed out by a newer one)."""
    flags = ["--sampler", "vllm", "--batch-size", "2", "--set", "torch.lora_rank=8", "--set", "torch.dtype=float32"]
    gate = {"serve.gate": "env", "serve.gate_env": "arithmetic", "serve.gate_problems": 2,
            "serve.gate_min_reward": 2.0,  # above any reward arithmetic gives: every candidate is rejected
            "vllm.gpu_memory_utilization": 0.2, "vllm.max_model_len": 128}  # fmt: skip
    flags += [word for key, value in gate.items() for word in ("--set", f"{key}={value}")]
    run_dir = tmp_path / "d"
    with serving(run_dir, *flags, ready_s=900) as server:
        ids = [server.chat(f"hello {i}")[0].id for i in range(2)]
        before = [(r["scope"], r["version"]) for r in log_events(run_dir, "vllm_lora_loaded")]
        assert before == [(None, 0)]  # the incumbent's adapter, loaded for the first request
        assert server.post("/v1/feedback", [{"id": c, "reward": float(r)} for r, c in enumerate(ids)]).is_success
        line = server.wait_for_line(1, timeout_s=300)
        assert (line["outcome"], line["version"]) == ("rejected", 1), line
        assert server.chat("next")[1] == 0 and server.chat("again")[1] == 0
        # nothing of version 1 reached vLLM; version 0's adapter was neither released nor loaded again
        assert [(r["scope"], r["version"]) for r in log_events(run_dir, "vllm_lora_loaded")] == before
        assert log_events(run_dir, "vllm_lora_released") == []
        listed = {e["version"]: e for e in server.versions_listing()["data"]}
        assert "handoff" in listed[0] and "handoff" not in listed[1]
