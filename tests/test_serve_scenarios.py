"""`serve.per_scenario = true`: each scenario its own chain of versions, candidates and rollback on
one base model (the tiny model, torch): two scenarios trained and rolled back independently, live
and offline, across kill -9 and --resume; `GET /v1/scenarios/{s}/versions` lists a chain."""

from __future__ import annotations

import json
import signal
import subprocess

import httpx
import pytest

from tests.serve_support import TOKEN, command, serving

FLAGS = ("--set", "serve.per_scenario=true", "--batch-size", "2")


def chain(server, scenario: str) -> dict:
    reply = httpx.get(
        f"{server.url}/scenarios/{scenario}/versions", headers={"authorization": f"Bearer {TOKEN}"}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def train(server, scenario: str, via_header: bool = False) -> None:
    """Two scored chats of ``scenario``: one candidate of its chain."""
    ids = []
    for i in range(2):
        if via_header:
            raw = server.client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": f"{scenario} {i}"}], max_tokens=6,
                extra_headers={"x-headrace-scenario": scenario},
            )  # fmt: skip
            ids.append(raw.parse().id)
        else:
            ids.append(server.chat(f"{scenario} {i}", scenario=scenario)[0].id)
    assert server.post("/v1/feedback", [{"id": ids[0], "reward": 0.0}, {"id": ids[1], "reward": 1.0}]).is_success


def logprobs(server, scenario: str | None) -> list[float]:
    completion, _ = server.chat("same prompt", scenario=scenario, seed=3, temperature=1.0, logprobs=True)
    return [t.logprob for t in completion.choices[0].logprobs.content]


@pytest.mark.slow
def test_two_scenarios_train_and_roll_back_independently(tmp_path):
    run_dir = tmp_path / "d"
    with serving(run_dir, *FLAGS) as server:
        base = logprobs(server, None)
        train(server, "a")
        server.wait_for_output("published scenario 'a' version 1")
        assert chain(server, "a")["incumbent"] == 1 and chain(server, "a")["data"][1]["completions"] == 2
        assert server.chat("x", scenario="a")[1] == 1 and server.chat("x", scenario="b")[1] == 0  # b starts at 0
        assert chain(server, "b")["incumbent"] == 0 and server.chat("x")[1] == 0  # the service's own chain
        assert logprobs(server, "b") == base  # b's version 0 is the base model
        train(server, "b", via_header=True)
        server.wait_for_output("published scenario 'b' version 1")
        train(server, "a")
        server.wait_for_output("published scenario 'a' version 2")
        a2, b1 = logprobs(server, "a"), logprobs(server, "b")
        assert a2 != b1 and a2 != base and b1 != base  # one set of weights per scenario
        done = server.post("/v1/admin/rollback", {"version": 1, "scenario": "a"})
        assert done.status_code == 200 and done.json()["outcome"] == "rollback"
        assert server.chat("x", scenario="a")[1] == 1 and server.chat("x", scenario="b")[1] == 1
        assert logprobs(server, "b") == b1  # b's chain untouched
        assert server.post("/v1/admin/rollback", {"version": 2, "scenario": "b"}).status_code == 404
        assert server.post("/v1/admin/rollback", {"version": 0, "scenario": "zz"}).status_code == 404
        bad = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                   "metadata": {"scenario": "../etc"}})  # fmt: skip
        assert bad.status_code == 400 and "scenario" in bad.json()["error"]["message"]
        assert httpx.get(server.url.removesuffix("/v1") + "/healthz").json()["scenarios"] == {"a": 1, "b": 1}
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
    with serving(run_dir, "--resume") as server:
        assert server.chat("x", scenario="a")[1] == 1 and server.chat("x", scenario="b")[1] == 1
        assert logprobs(server, "b") == b1  # its adapter came back from its checkpoint
        outcomes = [(e["outcome"], e["version"]) for e in chain(server, "a")["data"]]
        assert outcomes == [("initial", 0), ("published", 1), ("published", 2), ("rollback", 1)]
    offline = subprocess.run(
        [*command(run_dir)[:3], "rollback", str(run_dir), "--to", "0", "--scenario", "b"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert offline.returncode == 0 and "scenario 'b' version 0" in offline.stdout, offline.stderr
    # the next --resume serves it, as it served a's live rollback above
    last = json.loads((run_dir / "scenarios" / "b" / "versions.jsonl").read_text().splitlines()[-1])
    assert (last["outcome"], last["version"], last["parent"]) == ("rollback", 0, 1)
    assert [e["outcome"] for e in server.versions()] == ["initial"]  # the service's own chain never trained


@pytest.mark.timeout(120)
async def test_a_scenario_cut_before_its_first_line_starts_again_from_version_0(tmp_path):
    """kill -9 between a scenario's directory and its chain's first line: it restarts, at version 0."""
    from headrace.run.backends import make_backend
    from headrace.run.config import build_config
    from headrace.run.defaults import apply_model_defaults
    from headrace.serve.service import Service

    flags = {"backend": "torch", "model": "tiny", "env": "serve", "run_dir": str(tmp_path)}
    config = apply_model_defaults(build_config(flags=flags, overrides=["serve.per_scenario=true"]))
    (tmp_path / "scenarios" / "a").mkdir(parents=True)
    (tmp_path / "scenarios" / "a" / "versions.jsonl").write_text("")
    async with make_backend(config) as backend:
        service = Service(config, backend, tmp_path, say=lambda _: None)
        try:
            await service.start()
            lane = service.lanes["a"]
            assert lane.serving.version == 0 and [e["outcome"] for e in lane.chain.entries] == ["initial"]
            assert lane.chain.entries[0]["checkpoint"] == service.chain.entries[0]["checkpoint"]
        finally:
            service.close()


def test_per_scenario_with_a_one_version_sampler_is_refused_before_it_starts(tmp_path):
    import os
    import sys

    env = os.environ | {"HEADRACE_API_TOKEN": TOKEN}
    argv = [sys.executable, "-m", "headrace", "serve", "--sampler", "vllm", "--run-dir", str(tmp_path / "d"),
            "--set", "serve.per_scenario=true"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "per_scenario" in done.stderr and "Traceback" not in done.stderr, done.stderr
