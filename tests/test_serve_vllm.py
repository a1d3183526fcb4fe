"""`headrace serve --sampler vllm`: the torch trainer forks candidates, vLLM serves the incumbent
(a published candidate's weights reach vLLM before it answers)."""

from __future__ import annotations

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
