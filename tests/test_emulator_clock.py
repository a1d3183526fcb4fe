"""The emulator's lock-step clock: hard cycle boundaries by default (an op that arrives after a
boundary waits for the next one, as the service promises), the ``follow_s`` window as an
explicit option, and ``max_ops_per_cycle``, the conservative model of the service (at most N
compute ops per model per cycle, the rest in order in the next). Cycle numbers are read from the
emulator's request records; requests are raw HTTP, so the test controls when each one arrives."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from tinker_support import emulator, tinker_env  # noqa: F401 - fixture

pytestmark = [pytest.mark.tinker, pytest.mark.timeout(90)]


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=20) as r:  # noqa: S310 - loopback
        return json.loads(r.read())


def _record(emu, request_id: str, until: str = "complete_t", timeout_s: float = 20.0) -> dict:
    """The request's log record, once it has ``until`` (polled every few ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rec = next(r for r in emu.log() if r.get("request_id") == request_id)
        if rec.get(until) is not None:
            return rec
        assert time.monotonic() < deadline, f"{request_id} never reached {until}: {rec}"
        time.sleep(0.003)


def _model(emu, session: str, seq: int) -> str:
    body = {"session_id": session, "model_seq_id": seq, "base_model": "tiny", "lora_config": {"rank": 1}}
    future = _post(emu.url, "/api/v1/create_model", body)
    _record(emu, future["request_id"])
    return future["model_id"]


class Ops:
    """Raw submissions of one model's ops, with the seq ids the SDK would give them."""

    def __init__(self, emu, model_id: str):
        self.emu, self.model_id, self.seq = emu, model_id, 0

    def submit(self, op: str = "optim_step") -> str:
        self.seq += 1
        body = {"model_id": self.model_id, "seq_id": self.seq}
        body |= {"adam_params": {"learning_rate": 0.01}} if op == "optim_step" else {"path": f"s{self.seq}"}
        return _post(self.emu.url, f"/api/v1/{op}", body)["request_id"]


def _just_after_a_boundary(ops: Ops) -> dict:
    """Submit an op and wait until it starts: a boundary has just passed. Its record."""
    return _record(ops.emu, ops.submit(), until="start_t")


def _late_op(follow_s: float) -> tuple[dict, dict]:
    """Op A arrives shortly before a boundary, op B shortly after it, while A runs in the cycle
    that boundary opened."""
    cycle_s = 0.5
    with emulator(clock_cycle_s=cycle_s, latency_s=0.15) as emu:
        session = _post(emu.url, "/api/v1/create_session", {"tags": []})["session_id"]
        ops = Ops(emu, _model(emu, session, 0))
        probe = _just_after_a_boundary(ops)  # the grid is now known, to a few ms
        emu.set_knobs(follow_s=follow_s)
        boundary = probe["start_t"] + 2 * cycle_s
        time.sleep(max(boundary - 0.08 - time.time(), 0))
        a_id = ops.submit()
        time.sleep(max(boundary + 0.05 - time.time(), 0))
        b_id = ops.submit()
        a, b = _record(emu, a_id), _record(emu, b_id)
    assert a["grid_cycle"] == probe["grid_cycle"] + 2, (probe, a)  # A made the boundary aimed at
    assert boundary < b["submit_t"] < a["complete_t"], (a, b)  # B came after it, while A was still running
    return a, b


def test_an_op_that_arrives_just_after_a_boundary_waits_for_the_next_cycle():
    a, b = _late_op(follow_s=0.0)  # the default
    assert a["start_t"] < b["submit_t"]
    assert b["cycle"] == a["cycle"] + 1 and b["grid_cycle"] == a["grid_cycle"] + 1
    assert b["start_t"] >= a["start_t"] + 0.4  # a cycle later, not the moment A finished


def test_the_follow_window_lets_a_late_op_join_its_predecessors_cycle():
    a, b = _late_op(follow_s=0.25)  # B arrives ~0.13 s after A: within the window
    assert b["cycle"] == a["cycle"] and b["grid_cycle"] == a["grid_cycle"]


def test_max_ops_per_cycle_caps_each_model_and_the_rest_waits_in_order():
    with emulator(clock_cycle_s=0.5, max_ops_per_cycle=2) as emu:
        session = _post(emu.url, "/api/v1/create_session", {"tags": []})["session_id"]
        first, second = Ops(emu, _model(emu, session, 0)), Ops(emu, _model(emu, session, 1))
        _just_after_a_boundary(first)  # everything below arrives within this cycle, before the next boundary
        submitted = time.time()
        mine = [first.submit() for _ in range(2)]  # fills the model's cycle
        mine += [first.submit("save_weights"), first.submit(), first.submit(), first.submit()]
        other = [second.submit(), second.submit()]
        assert time.time() - submitted < 0.3
        mine_r = [_record(emu, r) for r in mine]
        other_r = [_record(emu, r) for r in other]
    c = mine_r[0]["grid_cycle"]
    # two compute ops a cycle; a save does not count, and runs with the ops queued before it
    assert [r["grid_cycle"] - c for r in mine_r] == [0, 0, 0, 1, 1, 2]
    assert [r["cycle"] for r in mine_r] == sorted(r["cycle"] for r in mine_r)
    assert [r["grid_cycle"] - c for r in other_r] == [0, 0]  # the cap is per model
    starts = [r["start_t"] for r in mine_r]
    assert starts == sorted(starts)
