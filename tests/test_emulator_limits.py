"""The Tinker emulator as a long-lived server: validated knobs, 4xx for a client's mistakes, a
bounded request body, idle connections closed, and eviction of what it no longer needs (real
HTTP on loopback; the official SDK where a flow needs it)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker_support import emulator, tinker_env  # noqa: E402, F401 - fixture

pytestmark = [pytest.mark.tinker, pytest.mark.timeout(90)]


def _post(url: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url + path, data=data, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:  # noqa: S310 - loopback
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/emulator/stats", timeout=20) as r:  # noqa: S310 - loopback
        return json.loads(r.read())


def _datum(k: int) -> types.Datum:
    toks = [5 + k, 6, 7, 8]
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0, 1.0, 1.0]},
    )


async def _train(client, steps: int) -> None:
    for k in range(steps):
        fb = client.forward_backward([_datum(k)], "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=0.1))
        await asyncio.wait_for(fb, 20)
        await asyncio.wait_for(opt, 20)


async def test_a_badly_typed_knob_is_refused_and_the_server_keeps_serving():
    """Before: ``{"latency_s": "0.1"}`` was stored, and the next training op killed the clock."""
    with emulator() as emu:
        for bad in (
            {"latency_s": "0.1"},
            {"drop_every": -1},
            {"stall_every": 1.5},
            {"try_again_polls": True},
            {"clock_cycle_s": float("inf")},
            {"no_such_knob": 1},
        ):
            status, body = _post(emu.url, "/emulator/knobs", bad)
            assert status == 400, (bad, status, body)
            assert next(iter(bad)) in body["detail"]
        assert _post(emu.url, "/emulator/knobs", b"[1, 2]")[0] == 400
        status, knobs = _post(emu.url, "/emulator/knobs", {"latency_s": 0, "http_5xx_ops": ["optim_step"]})
        assert status == 200 and knobs["latency_s"] == 0 and knobs["drop_every"] == 0
        assert knobs["http_5xx_ops"] == ["optim_step"]
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
        await _train(client, 2)  # the clock still runs
        assert emu.models()[client.model_id]["steps"] == 2
        await service.close("success")


async def test_client_mistakes_are_answered_4xx_not_500():
    with emulator() as emu:
        status, session = _post(emu.url, "/api/v1/create_session", {"tags": []})
        assert status == 200
        sid = session["session_id"]
        cases = {
            "bad JSON": ("/api/v1/create_session", b"{not json", 400),
            "JSON that is not an object": ("/api/v1/optim_step", b"[1, 2]", 400),
            "bad protobuf": ("/api/v1/forward_backward", b"\xff\xfe not a protobuf", 400),
            "a missing field": ("/api/v1/optim_step", {}, 400),
            "a prompt of the wrong shape": ("/api/v1/asample", {"prompt": "x"}, 400),
            "an unknown model": ("/api/v1/optim_step", {"model_id": f"{sid}:train:7", "seq_id": 1}, 404),
            "an unknown model's info": ("/api/v1/get_info", {"model_id": "nope"}, 404),
            "an empty base model name": (
                "/api/v1/create_model",
                {"session_id": sid, "model_seq_id": 0, "base_model": ""},
                400,
            ),
            "a prompt token outside the vocabulary": (
                "/api/v1/asample",
                {"base_model": "Qwen/Qwen3-8B", "prompt": {"chunks": [{"tokens": [5, 65536]}]}},
                400,
            ),
            "a stop of the wrong shape": (
                "/api/v1/asample",
                {"base_model": "tiny", "prompt": {"chunks": [{"tokens": [5]}]}, "sampling_params": {"stop": [1, "x"]}},
                400,
            ),
            "a sampling option the emulator does not compute": (
                "/api/v1/asample",
                {"base_model": "tiny", "prompt": {"chunks": [{"tokens": [5]}]}, "topk_sample_logprobs": 2},
                400,
            ),
            "an unknown checkpoint": (
                "/api/v1/load_weights",
                {"session_id": sid, "model_seq_id": 1, "path": "tinker://x/weights/y"},
                404,
            ),
            "an unknown future": ("/api/v1/retrieve_future", {"request_id": "req-99999"}, 404),
            "an unknown sampling session": (
                "/api/v1/asample",
                {"sampling_session_id": f"{sid}:sample:9", "seq_id": 1, "prompt": {"chunks": [{"tokens": [5]}]}},
                404,
            ),
        }
        for what, (path, body, want) in cases.items():
            status, reply = _post(emu.url, path, body)
            assert status == want, (what, status, reply)
            assert reply.get("detail"), what
        assert emu.models() == {}  # nothing was created by any of them


async def test_a_body_over_the_limit_is_answered_413():
    with emulator(max_body_mib=0.01) as emu:  # ~10 KB
        status, reply = _post(emu.url, "/api/v1/telemetry", b'{"x": "' + b"a" * 50_000 + b'"}')
        assert status == 413 and "max_body_mib" in reply["detail"]
        assert _post(emu.url, "/api/v1/telemetry", {"events": []})[0] == 200  # a fresh connection is served


async def test_an_idle_connection_is_closed():
    with emulator(idle_connection_s=0.3) as emu:
        with socket.create_connection(("127.0.0.1", emu.port), timeout=5) as conn:
            conn.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            reply = b""
            while b'"ok"' not in reply:
                reply += conn.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            assert conn.recv(4096) == b""  # the server hung up on the idle keep-alive connection
            assert 0.2 < time.monotonic() - started < 4


async def _until(predicate, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)
    return value


async def test_fetched_futures_and_finished_sessions_are_evicted():
    """Before: every future, session, model and sampler stayed until the emulator stopped."""
    with emulator(future_grace_s=0.3, session_ttl_s=60) as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
        await _train(client, 3)
        sampler = await client.save_weights_and_get_sampling_client()
        await sampler.sample(types.ModelInput.from_ints([5, 6]), 2, types.SamplingParams(max_tokens=3, seed=1))
        fetched = [r["request_id"] for r in emu.log() if r["event"] == "op" and r.get("fetch_t")]
        assert len(fetched) >= 8
        # retrieved futures go after the grace period; the live session, its model and sampler stay
        stats = await _until(lambda: (s := _stats(emu.url))["futures"] == 0 and s)
        assert stats["sessions"] == 1 and stats["models"] == 1 and stats["samplers"] == 1 and stats["by_idem"] == 0
        status, reply = _post(emu.url, "/api/v1/retrieve_future", {"request_id": fetched[0]})
        assert status == 410 and "expired" in reply["detail"]  # gone, and said so: not "unknown"
        await _train(client, 1)  # the model trains on
        await service.close("success")
        # a finished session goes a grace period later, with its model and sampling sessions
        stats = await _until(lambda: (s := _stats(emu.url))["sessions"] == 0 and s)
        assert (stats["futures"], stats["models"], stats["samplers"], stats["by_seq"]) == (0, 0, 0, 0), stats
        assert stats["evicted"]["models"] == 1 and stats["evicted"]["futures"] >= 10


async def test_a_silent_session_is_evicted_after_its_ttl():
    with emulator(future_grace_s=0.2, session_ttl_s=0.5) as emu:
        status, session = _post(emu.url, "/api/v1/create_session", {"tags": []})
        sid = session["session_id"]
        assert _post(emu.url, "/api/v1/session_heartbeat", {"session_id": sid})[0] == 200
        await _until(lambda: _stats(emu.url)["sessions"] == 0)
        # the SDK stops its heartbeat loop on a 410
        assert _post(emu.url, "/api/v1/session_heartbeat", {"session_id": sid})[0] == 410


async def test_a_repeated_submission_after_its_future_was_evicted_is_not_run_again():
    with emulator(future_grace_s=0.2, session_ttl_s=60) as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
        await _train(client, 1)
        step = next(r for r in emu.log() if r["event"] == "op" and r["op"] == "optim_step")
        await _until(lambda: _stats(emu.url)["futures"] == 0)
        status, reply = _post(
            emu.url,
            "/api/v1/optim_step",
            {"model_id": client.model_id, "seq_id": step["seq_id"], "adam_params": {"learning_rate": 0.1}},
        )
        assert status == 410, reply  # its outcome can't be told; running it again would apply it twice
        assert emu.models()[client.model_id]["steps"] == 1
        await service.close("success")
