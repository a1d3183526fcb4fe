"""`serve.per_scenario` on vLLM: each scenario's incumbent is a LoRA adapter of its own on one
engine's base model (multi-LoRA), trained by the torch learner. One engine start (minutes on a
loaded machine): two scenarios published, each served by vLLM with its own adapter (the version
in the response, its chain, different logprobs of one seeded prompt: vllm.seed_requests), one
rolled back while the other keeps its adapter, and each published version's hand-off (save and
load seconds) in the versions listing."""

from __future__ import annotations

import json

import pytest

from tests.serve_support import serving
from tests.test_serve_scenarios import chain, logprobs, train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

FLAGS = ["--sampler", "vllm", "--batch-size", "2", "--set", "serve.per_scenario=true"]
SETS = {"torch.lora_rank": 8, "torch.dtype": "float32", "optim.learning_rate": 0.05, "vllm.seed_requests": "true",
        "vllm.gpu_memory_utilization": 0.2, "vllm.max_model_len": 128}  # fmt: skip
FLAGS += [word for key, value in SETS.items() for word in ("--set", f"{key}={value}")]


def log_events(run_dir, event: str) -> list[dict]:
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(str.strip, lines)) if r.get("event") == event]


def loads(run_dir) -> list[dict]:
    return log_events(run_dir, "vllm_lora_loaded")


@pytest.mark.timeout(1500)
def test_each_scenario_is_its_own_lora_on_one_vllm_engine(tmp_path):
    run_dir = tmp_path / "d"
    with serving(run_dir, *FLAGS, ready_s=900) as server:
        base = logprobs(server, None)
        train(server, "a")
        server.wait_for_output("published scenario 'a' version 1", timeout_s=300)
        train(server, "b")
        server.wait_for_output("published scenario 'b' version 1", timeout_s=300)
        assert server.chat("x", scenario="a")[1] == 1 and server.chat("x", scenario="b")[1] == 1
        a1, b1 = logprobs(server, "a"), logprobs(server, "b")
        assert a1 != b1 and a1 != base and b1 != base  # one adapter per scenario, each its own weights
        assert server.chat("x")[1] == 0 and logprobs(server, None) == base  # the service's own chain
        # every scenario's version 1 reached vLLM as an adapter of its own, and says how long it took
        loaded = {(r["scope"], r["version"]) for r in loads(run_dir)}
        assert {("a", 1), ("b", 1)} <= loaded
        for scenario in ("a", "b"):
            line = chain(server, scenario)["data"][1]
            assert line["outcome"] == "published" and line["handoff"]["load_s"] > 0 <= line["handoff"]["save_s"]
        own = server.versions_listing()
        assert own["incumbent"] == 0 and own["data"][0]["outcome"] == "initial" and "handoff" in own["data"][0]

        done = server.post("/v1/admin/rollback", {"version": 0, "scenario": "a"})
        assert done.status_code == 200 and done.json()["outcome"] == "rollback"
        assert server.chat("x", scenario="a")[1] == 0 and server.chat("x", scenario="b")[1] == 1
        assert logprobs(server, "a") == base and logprobs(server, "b") == b1  # b's adapter untouched
        assert chain(server, "b")["incumbent"] == 1 and chain(server, "a")["incumbent"] == 0
        # a's version 0 came back as an adapter once (kept while it serves: newer than a's 1), and a's
        # version 1 was released for it
        assert [(r["scope"], r["version"]) for r in loads(run_dir)].count(("a", 0)) == 2
        assert ("a", 1) in [(r["scope"], r["version"]) for r in log_events(run_dir, "vllm_lora_released")]
