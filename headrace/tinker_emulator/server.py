"""The emulator's HTTP surface: the ``/api/v1`` endpoints the Tinker SDK uses, the future
long-poll, fault injection at the door, the janitor that evicts what expired, and
``/emulator/*`` for tests (log, models, checkpoints, stats, knobs).

A client's mistake is answered 4xx with a body naming it, as the service does: malformed JSON
or protobuf, a missing field, a bad knob value (400), an unknown model, checkpoint or session
(404), a future or session that was evicted (410), a body over the limit (413). A 500 means a
bug in the emulator."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from headrace.net.http import DROP, HttpServer, Request, Response
from headrace.tinker_emulator.admission import ClientError, ServedNames
from headrace.tinker_emulator.clock import Clock
from headrace.tinker_emulator.codec import archive, decode_fwdbwd
from headrace.tinker_emulator.compute import Compute
from headrace.tinker_emulator.config import EmulatorConfig, make_compute
from headrace.tinker_emulator.faults import FaultPlan, Knobs
from headrace.tinker_emulator.ops import Ops
from headrace.tinker_emulator.state import EmulatorState, FutureRec, SamplingSession, Session

log = logging.getLogger(__name__)

API = "/api/v1/"
# POSTs whose reply is a future: where 5xx bursts and dropped responses are injected
OP_ENDPOINTS = {
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "create_model",
    "asample",
}
TRAINING_SUBMISSIONS = {"forward_backward", "optim_step", "save_weights", "save_weights_for_sampler"}
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "parallel_fwdbwd_chunks": True,
}


class Emulator:
    def __init__(
        self,
        compute: Compute,
        knobs: Knobs | None = None,
        log_path: str | None = None,
        serve_only: tuple[str, ...] | list[str] = (),
    ):
        self.compute = compute
        self.knobs = knobs or Knobs()
        self.faults = FaultPlan(self.knobs)
        self.state = EmulatorState(log_path, self.knobs.log_records)
        self.clock = Clock(self.knobs)
        self.names = ServedNames(compute.models, serve_only)
        self.ops = Ops(self.state, compute, self.knobs, self.faults, self.clock, self.names)
        self.http = HttpServer(self.handle, limits=self.knobs)
        self._tasks: list[asyncio.Task[None]] = []  # the clock and the janitor
        self._stack = contextlib.AsyncExitStack()  # holds the task group of the clock, the ops and the connections
        self.config: EmulatorConfig | None = None  # set by from_config: where start() listens

    @classmethod
    def from_config(cls, config: EmulatorConfig, compute: Compute | None = None) -> Emulator:
        """The emulator ``config`` describes; ``compute`` replaces the one it names (a test's own)."""
        compute = compute if compute is not None else make_compute(config)
        emulator = cls(compute, config.knobs, config.log, config.serve_only)
        emulator.config = config
        return emulator

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Serve until ``close()``, which must be awaited in the task that started it: the clock,
        the janitor, the ops and the connections run in a task group entered here, so a failure
        in one of them cancels that task and ``close()`` raises it, instead of the emulator
        hanging on a dead clock. ``host`` and ``port`` default to the config's (else loopback, a
        free port)."""
        host = host or (self.config.host if self.config else "127.0.0.1")
        port = port if port is not None else (self.config.port if self.config else 0)
        tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        self.http = HttpServer(self.handle, host, port, limits=self.knobs)
        await self.http.start(tasks)
        self.ops.group = tasks
        self._tasks = [
            tasks.create_task(self.clock.run(), name="tinker-emulator-clock"),
            tasks.create_task(self._janitor(), name="tinker-emulator-janitor"),
        ]
        return self.http.port

    async def close(self) -> None:
        await self.http.close()
        for task in self._tasks:
            task.cancel()
        self.ops.cancel()
        try:
            await self._stack.aclose()  # awaits the clock and the ops; raises what failed in them
        finally:
            await self.compute.close()
            self.state.close()

    async def _janitor(self) -> None:
        """Evict what expired, a few times per grace period (at most every 5 s)."""
        while True:
            await asyncio.sleep(min(max(min(self.knobs.future_grace_s, self.knobs.session_ttl_s) / 4, 0.05), 5.0))
            for trainer in self.state.evict(self.knobs.future_grace_s, self.knobs.session_ttl_s):
                try:
                    await trainer.close()
                except Exception:  # noqa: BLE001 - a model that fails to close is gone all the same
                    log.exception("closing an evicted model failed")

    # -- dispatch --------------------------------------------------------------------------

    async def handle(self, req: Request) -> Response | object:
        try:
            if req.path.startswith("/emulator/"):
                return self._admin(req)
            if not req.path.startswith(API):
                return Response.error(404, f"no route {req.method} {req.path}")
            return await self._api(req, req.path[len(API) :])
        except ClientError as e:
            return Response.error(e.status, str(e))
        except KeyError as e:
            return Response.error(400, f"bad request to {req.path}: missing field {e}")
        except (ValueError, TypeError) as e:
            return Response.error(400, f"bad request to {req.path}: {e}")

    async def _api(self, req: Request, name: str) -> Response | object:
        if req.method == "POST" and name in self.knobs.http_5xx_ops and self.faults.http_5xx():
            self.state.event("fault", kind="http_503", path=req.path)
            response = Response.error(503, "injected fault: service unavailable")
            response.headers["retry-after-ms"] = str(self.knobs.retry_after_ms)
            return response
        idem = req.headers.get("x-idempotency-key") if name in OP_ENDPOINTS else None
        if idem and idem in self.state.by_idem:
            self.state.event("dedup", path=req.path, idempotency_key=idem)
            return self.state.by_idem[idem]
        reply = await self._route(req, name)
        if idem and isinstance(reply, Response) and reply.status == 200:
            self.state.cache_reply(idem, reply)
        if name in TRAINING_SUBMISSIONS and self.faults.drop_submission():
            self.state.event("fault", kind="drop_response", path=req.path)
            return DROP
        return reply

    async def _route(self, req: Request, name: str) -> Response | object:
        if req.method == "GET":
            if name == "healthz":
                return Response.of_json({"status": "ok"})
            if name == "get_server_capabilities":
                return Response.of_json(self.names.capabilities(self.compute))
            if name.startswith("training_runs/") and name.endswith("/archive"):
                return await self._archive(req, name)
            if name.startswith("samplers/"):
                sampler = self.state.samplers.get(name.split("/", 1)[1])
                if sampler is None:
                    return Response.error(404, f"unknown sampler '{name}'")
                return Response.of_json(
                    {
                        "sampler_id": sampler.session_id,
                        "base_model": sampler.base_model,
                        "model_path": sampler.model_path,
                    }
                )
            return Response.error(404, f"no route GET {req.path}")
        if name == "forward_backward":
            fb = decode_fwdbwd(req.body, req.headers.get("content-encoding"), int(self.knobs.max_body_mib * 2**20))
            return self._future_reply(self.ops.forward_backward(fb))
        body = req.json()
        if name == "retrieve_future":
            return await self._retrieve(str(body["request_id"]))
        handler = {
            "client/config": lambda: Response.of_json(CLIENT_CONFIG),
            "client/dynamic_config": lambda: Response.of_json({}),
            "create_session": lambda: self._create_session(body),
            "session_heartbeat": lambda: self._heartbeat(body),
            "telemetry": lambda: Response.of_json({"status": "accepted"}),
            "cancel_future": lambda: Response.of_json({}),
            "create_model": lambda: self._future_reply(self.ops.create_model(body)),
            "get_info": lambda: self._get_info(body),
            "optim_step": lambda: self._future_reply(self.ops.optim_step(body)),
            "save_weights": lambda: self._future_reply(self.ops.save_weights(body, for_sampler=False)),
            "save_weights_for_sampler": lambda: self._future_reply(self.ops.save_weights(body, for_sampler=True)),
            "load_weights": lambda: self._future_reply(self.ops.load_weights(body)),
            "asample": lambda: self._sample_reply(body),
        }.get(name)
        if handler is not None:
            return handler()
        if name == "create_sampling_session":
            return await self._create_sampling_session(body)
        if name.startswith("sessions/") and name.endswith("/finish"):
            session = self.state.sessions.get(name.split("/")[1])
            if session is not None:  # forgotten a grace period from now, like its futures
                session.finished, session.last_seen = True, time.monotonic()
            return Response.of_json({})
        return Response.error(404, f"no route POST {req.path}")

    @staticmethod
    def _future_reply(rec: FutureRec) -> Response:
        return Response.of_json({"request_id": rec.request_id, "model_id": rec.model_id})

    def _sample_reply(self, body: dict[str, Any]) -> Response:
        rec, n = self.ops.sample(body)
        return Response.of_json(
            {"request_id": rec.request_id, "sample_sequence_ids": [f"{rec.request_id}:{i}" for i in range(n)]}
        )

    # -- sessions and info -----------------------------------------------------------------

    def _create_session(self, body: dict[str, Any]) -> Response:
        sid = self.state.new_id("session")
        self.state.sessions[sid] = Session(tags=body.get("tags"))
        return Response.of_json({"session_id": sid, "type": "create_session"})

    def _heartbeat(self, body: dict[str, Any]) -> Response:
        sid = str(body["session_id"])
        if sid not in self.state.sessions:
            # 410 tells the SDK the session is over, and it stops its heartbeat loop
            status = 410 if self.state.was_issued(sid) else 404
            return Response.error(status, f"session '{sid}' {'expired' if status == 410 else 'is unknown'}")
        self.state.touch(sid)
        return Response.of_json({"type": "session_heartbeat"})

    def _get_info(self, body: dict[str, Any]) -> Response:
        model = self.state.models.get(body["model_id"])
        if model is None:
            return Response.error(404, f"unknown model_id '{body['model_id']}'")
        return Response.of_json(
            {
                "type": "get_info",
                "model_id": model.model_id,
                "is_lora": True,
                "lora_rank": model.rank,
                "model_data": {
                    "arch": "llama",
                    "model_name": model.base_model,
                    # a name served by a model of its own: headrace's; an alias: what the service would say
                    "tokenizer_id": f"headrace/{model.base_model}"
                    if model.base_model in self.names.models
                    else model.base_model,
                },
            }
        )

    async def _create_sampling_session(self, body: dict[str, Any]) -> Response:
        sid = f"{body['session_id']}:sample:{body['sampling_session_seq_id']}"
        self.state.touch(sid)
        if sid not in self.state.samplers:
            path = body.get("model_path")
            try:
                if path:
                    sampler, base = await self.ops.sampler_for_path(path)
                else:
                    base = body.get("base_model") or self.names.models[0]
                    sampler = await self.compute.base_sampler(self.names.resolve(base))
            except (KeyError, ValueError) as e:
                return Response.error(404, str(e))
            self.state.samplers[sid] = SamplingSession(sid, base, sampler, path)
        return Response.of_json({"sampling_session_id": sid, "type": "create_sampling_session"})

    # -- checkpoint archives ---------------------------------------------------------------

    async def _archive(self, req: Request, name: str) -> Response:
        """``GET training_runs/{run}/checkpoints/{type}/{name}/archive``: the service's answer, a
        302 to a signed URL of the checkpoint's tar (here a one-time URL under ``/emulator``)."""
        parts = name.split("/")
        if len(parts) != 6 or parts[2] != "checkpoints":
            return Response.error(404, f"no route GET {req.path}")
        path = f"tinker://{parts[1]}/{parts[3]}/{parts[4]}"
        ckpt = self.state.checkpoints.get(path)
        if ckpt is None:
            return Response.error(404, f"no checkpoint at '{path}' on this emulator (never saved, or expired)")
        if parts[3] != "sampler_weights":
            return Response.error(
                400, f"'{path}' is a training state; this emulator archives sampler weights "
                "(save_weights_for_sampler) only",
            )  # fmt: skip
        files = getattr(ckpt.blob, "adapter_files", None)
        if files is None:
            return Response.error(
                400, f"the emulator's '{type(self.compute).__name__}' compute keeps no weights to archive; start it "
                "with --compute torch",
            )  # fmt: skip
        token = self.state.add_archive(archive(await files()))
        self.state.event("archive", path=path, token=token)
        host = req.headers.get("host") or f"127.0.0.1:{self.http.port}"
        expires = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 900))
        where = f"http://{host}/emulator/archives/{token}"
        return Response(302, b"", "text/plain", {"location": where, "expires": expires})

    # -- futures ---------------------------------------------------------------------------

    async def _retrieve(self, request_id: str) -> Response | object:
        rec = self.state.futures.get(request_id)
        if rec is None:
            if self.state.was_issued(request_id):
                return Response.error(410, f"the result of '{request_id}' expired (knob future_grace_s)")
            return Response.error(404, f"unknown request_id '{request_id}'")
        self.state.touch(rec.model_id)
        if rec.try_again_left > 0:
            rec.try_again_left -= 1
            self.state.event("try_again", request_id=request_id, op=rec.op)
            return Response.of_json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if not rec.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rec.done.wait(), self.knobs.long_poll_s)
        if not rec.done.is_set():
            return Response.of_json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if self.faults.drop_fetch():
            self.state.event("fault", kind="drop_fetch", request_id=request_id)
            return DROP
        if rec.log.get("fetch_t") is None:
            rec.log["fetch_t"], rec.fetched_at = time.time(), time.monotonic()
            self.state.event("fetch", request_id=request_id, op=rec.op, model_id=rec.model_id)  # for the log file
        assert rec.response is not None
        return rec.response

    # -- /emulator -------------------------------------------------------------------------

    def _admin(self, req: Request) -> Response:
        what = req.path[len("/emulator/") :]
        if what == "log":
            return Response.of_json({"records": list(self.state.records), "cycles": self.clock.cycles})
        if what == "models":
            return Response.of_json(self.state.models_view())
        if what == "checkpoints":
            return Response.of_json(self.state.checkpoints_view())
        if what.startswith("archives/"):
            blob = self.state.archives.get(what.split("/", 1)[1])
            if blob is None:
                return Response.error(404, f"no archive at {req.path} (it expired: ask for its URL again)")
            return Response(200, blob, "application/x-tar")
        if what == "stats":
            return Response.of_json({**self.state.stats(), "http": self.http.stats})
        if what == "knobs":
            if req.method == "POST":
                # validated as a whole before anything is set: a bad value is refused, never stored
                self.knobs.set_from(self.knobs.updated(req.json()))  # the clock reads them each cycle
                self.state.keep_records(self.knobs.log_records)
            return Response.of_json(dataclasses.asdict(self.knobs))
        return Response.error(404, f"no route {req.path}")
