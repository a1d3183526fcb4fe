"""The operations behind the future-returning endpoints: model creation, training, weights, sampling.

Ops on a model carry a ``seq_id`` and run on the lock-step ``Clock`` in arrival order; model
creation and sampling run at once as tasks. Each op resolves a ``FutureRec`` with the payload
``retrieve_future`` will serve (protobuf for forward/backward and samples, JSON for the rest).
What can be refused at the door (an unknown model, checkpoint or base model, a key whose
future expired, a token id outside the model's vocabulary, a sampling option the emulator does
not compute) is refused there, with a 4xx the server answers.

The names served and a sample request's options are checked in ``admission.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from headrace.net.http import Response
from headrace.tinker_emulator.admission import ClientError, ServedNames, prompt_logprob_options, sample_spec
from headrace.tinker_emulator.clock import Clock
from headrace.tinker_emulator.codec import FwdBwdRequest, encode_fwdbwd_output, encode_sample_response
from headrace.tinker_emulator.compute import Compute, check_token_ids, empty_topk, stop_at_strings
from headrace.tinker_emulator.faults import FaultPlan, Knobs
from headrace.tinker_emulator.state import (
    EXPIRED,
    Checkpoint,
    EmulatorState,
    FutureRec,
    ModelRec,
    SamplingSession,
    digest,
)

LATER: Any = object()  # a work function's answer: the future is resolved later, by a task


def _error(message: str, category: str) -> Response:
    return Response.of_json({"error": message, "category": category})


def _expired(key: str, seq_id: int | None) -> ClientError:
    return ClientError(
        410,
        f"request {seq_id} of '{key}' was already processed and its result has expired "
        "(knob future_grace_s); its outcome can no longer be told",
    )


class Ops:
    def __init__(
        self,
        state: EmulatorState,
        compute: Compute,
        knobs: Knobs,
        faults: FaultPlan,
        clock: Clock,
        names: ServedNames | None = None,
    ):
        self.state, self.compute, self.knobs, self.faults, self.clock = state, compute, knobs, faults, clock
        self.names = names or ServedNames(compute.models)
        self.group: asyncio.TaskGroup | None = None  # the emulator's task group, set while it serves
        self._tasks: set[asyncio.Task[None]] = set()  # the running ones, for cancel()

    def cancel(self) -> None:
        """Cancel the ops still running; the emulator's task group awaits them."""
        for task in list(self._tasks):
            task.cancel()

    # -- plumbing --------------------------------------------------------------------------

    async def _resolve(
        self,
        rec: FutureRec,
        work: Callable[[], Awaitable[Response]],
        cycle: int | None = None,
        latency_s: float = 0.0,
        grid_cycle: int | None = None,
    ) -> None:
        rec.log["cycle"], rec.log["grid_cycle"], rec.log["start_t"] = cycle, grid_cycle, time.time()
        try:
            if latency_s:
                await asyncio.sleep(latency_s)
            response = await work()
            if response is LATER:
                return
        except (ValueError, KeyError) as e:
            response = _error(f"{type(e).__name__}: {e}", "user")
        except Exception as e:  # noqa: BLE001 - a compute failure is the request's error, not the server's
            response = _error(f"{type(e).__name__}: {e}", "server")
        rec.finish(response)
        self.state.write_op(rec)

    def _later(self, rec: FutureRec, response: Response, delay_s: float) -> None:
        """Resolve ``rec`` after ``delay_s``, off the clock (a stalled result must not stall the server)."""

        async def finish() -> None:
            await asyncio.sleep(delay_s)
            rec.finish(response)
            self.state.write_op(rec)

        self._run(finish())

    def _spawn(self, rec: FutureRec, work: Callable[[], Awaitable[Response]]) -> None:
        self._run(self._resolve(rec, work))

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        # in the emulator's task group: a bug here stops the emulator loudly, not one future silently
        assert self.group is not None, "the emulator is not serving (Emulator.start)"
        task = self.group.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_clock(self, rec: FutureRec, model_id: str, op: str, work: Callable[[], Awaitable[Response]]) -> None:
        async def run(cycle: int, grid_cycle: int | None) -> None:
            await self._resolve(rec, work, cycle, self.knobs.latency_s, grid_cycle)

        self.clock.submit(model_id, op, run)

    def _model(self, model_id: str) -> ModelRec:
        model = self.state.models.get(model_id)
        if model is None:
            raise KeyError(f"unknown model_id '{model_id}'")
        return model

    def _submit(self, op: str, model_id: str, seq_id: int | None, work: Callable[[], Awaitable[Response]]) -> FutureRec:
        """A model op: deduplicated by (model_id, seq_id), then queued on the clock."""
        old = self.state.existing(model_id, seq_id)
        if old is EXPIRED:
            raise _expired(model_id, seq_id)
        if not self.state.model_known(model_id):
            raise ClientError(404, f"unknown model_id '{model_id}'")
        self.state.touch(model_id)
        if old is not None:
            self.state.event("dedup", op=op, model_id=model_id, seq_id=seq_id, request_id=old.request_id)
            return old
        rec = self.state.new_future(op, model_id, seq_id, self.knobs.try_again_polls)
        self._on_clock(rec, model_id, op, work)
        return rec

    # -- models ----------------------------------------------------------------------------

    def create_model(self, body: dict[str, Any]) -> FutureRec:
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
        old = self._created(model_id)
        if old is not None:
            return old
        lora = {"rank": 32, **(body.get("lora_config") or {})}
        base, rank = body["base_model"], int(lora["rank"])
        computed = self.names.resolve(base)
        rec = self.state.new_future("create_model", model_id, 0, self.knobs.try_again_polls)

        async def work() -> Response:
            trainer = await self.compute.create(computed, lora)
            self.state.models[model_id] = ModelRec(model_id, base, rank, trainer, lora=lora)
            return Response.of_json({"model_id": model_id, "type": "create_model"})

        self._spawn(rec, work)
        return rec

    def _created(self, model_id: str) -> FutureRec | None:
        """The future of this model's creation if it was already asked for (a retry)."""
        self.state.touch(model_id)
        old = self.state.existing(model_id, 0)
        if old is EXPIRED:
            raise _expired(model_id, 0)
        return old

    def load_weights(self, body: dict[str, Any]) -> FutureRec:
        path, optimizer = body["path"], bool(body.get("optimizer"))
        if path not in self.state.checkpoints:  # the service answers 404 before creating anything
            raise ClientError(
                404,
                f"no checkpoint at '{path}' on this emulator (never saved, expired, or saved "
                "before the emulator restarted)",
            )
        if body.get("model_id"):  # load into an existing model, in its queue
            model_id = body["model_id"]

            async def work_existing() -> Response:
                model, ckpt = self._model(model_id), self._checkpoint(path)
                await model.trainer.load(ckpt.blob, optimizer)
                model.lineage, model.pending, model.parent = list(ckpt.lineage), [], path
                return Response.of_json({"path": path, "model_id": model_id, "type": "load_weights"})

            return self._submit("load_weights", model_id, body.get("seq_id"), work_existing)
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
        old = self._created(model_id)
        if old is not None:
            return old
        rec = self.state.new_future("load_weights", model_id, 0, self.knobs.try_again_polls)

        async def work_new() -> Response:
            ckpt = self._checkpoint(path)
            trainer = await self.compute.create(self.names.computed_by(ckpt.base_model), ckpt.lora)
            await trainer.load(ckpt.blob, optimizer)
            self.state.models[model_id] = ModelRec(
                model_id, ckpt.base_model, ckpt.rank, trainer, list(ckpt.lineage), [], path, ckpt.lora
            )
            return Response.of_json({"path": path, "model_id": model_id, "type": "load_weights"})

        self._spawn(rec, work_new)
        return rec

    def _checkpoint(self, path: str) -> Checkpoint:
        ckpt = self.state.checkpoints.get(path)
        if ckpt is None:
            raise KeyError(f"no checkpoint at '{path}' on this emulator")
        return ckpt

    # -- training --------------------------------------------------------------------------

    def forward_backward(self, req: FwdBwdRequest) -> FutureRec:
        op = "forward" if req.forward_only else "forward_backward"
        model_rec = self.state.models.get(req.model_id)
        if model_rec is not None:  # else unknown (404 below) or still being created: the compute checks
            vocab = self.compute.vocab_size(self.names.computed_by(model_rec.base_model))
            for d in req.data:
                check_token_ids("a datum's model_input", d.tokens, vocab)
                if "target_tokens" in d.inputs:
                    check_token_ids("a datum's target_tokens", d.inputs["target_tokens"], vocab)

        async def work() -> Response:
            model = self._model(req.model_id)
            logprobs_D, metrics = await model.trainer.forward_backward(
                req.data, req.loss_fn, req.loss_fn_config, req.forward_only
            )
            if not req.forward_only:
                step = digest(req.data)
                if self.faults.nan_loss():  # the service computed garbage: the loss says so, the gradient is poisoned
                    self.state.event("fault", kind="nan_loss", request_id=rec.request_id, model_id=req.model_id)
                    metrics = {**metrics, "loss:sum": float("nan")}
                    step = f"nan:{step}"
                    if hasattr(model.trainer, "poison"):
                        await model.trainer.poison()
                model.pending.append(step)
                rec.log["applied"] = True
            return Response.of_proto(encode_fwdbwd_output(logprobs_D, metrics))

        rec = self._submit(op, req.model_id, req.seq_id, work)
        # what the request carried, for tests and the request log: the loss and its datums' weights
        weights = [d.inputs["weights"] for d in req.data if "weights" in d.inputs]
        rec.log.setdefault("loss_fn", req.loss_fn)
        rec.log.setdefault("datums", len(req.data))
        if weights:
            rec.log.setdefault("weights_sum", float(sum(float(np.sum(w)) for w in weights)))
            rec.log.setdefault("weights_nonzero", int(sum(int(np.count_nonzero(w)) for w in weights)))
            rec.log.setdefault("weights_negative", int(sum(int((w < 0).sum()) for w in weights)))
        return rec

    def optim_step(self, body: dict[str, Any]) -> FutureRec:
        model_id = body["model_id"]
        params = body.get("adam_params") or body.get("optimizer_params") or body.get("optim_params") or {}

        async def work() -> Response:
            model = self._model(model_id)
            metrics = await model.trainer.optim_step(params)
            model.lineage.append(digest_of(model.pending))
            model.pending = []
            rec.log.update(applied=True, step=len(model.lineage), step_digest=model.lineage[-1])
            if self.faults.stall("optim_step"):
                self.state.event("fault", kind="stall", request_id=rec.request_id, model_id=model_id)
                ok = Response.of_json({"metrics": metrics, "type": "optim_step"})
                self._later(rec, ok, self.knobs.stall_s)
                return LATER
            if self.faults.fail_after_apply("optim_step"):
                self.state.event("fault", kind="fail_after_apply", request_id=rec.request_id, model_id=model_id)
                return _error("injected fault: the step was applied but its result was lost", "server")
            return Response.of_json({"metrics": metrics, "type": "optim_step"})

        rec = self._submit("optim_step", model_id, body.get("seq_id"), work)
        return rec

    def save_weights(self, body: dict[str, Any], for_sampler: bool) -> FutureRec:
        model_id, name = body["model_id"], body.get("path")

        async def work() -> Response:
            model = self._model(model_id)
            if for_sampler:
                sampler = await model.trainer.sampler()
                if name is None:
                    sid = f"{model_id.split(':train:')[0]}:sample:{body.get('sampling_session_seq_id')}"
                    self.state.samplers[sid] = SamplingSession(sid, model.base_model, sampler)
                    return Response.of_json({"sampling_session_id": sid, "type": "save_weights_for_sampler"})
                path = f"tinker://{model_id}/sampler_weights/{name}"
                self.state.checkpoints[path] = Checkpoint(
                    path, model.base_model, model.rank, sampler, list(model.lineage), model.lora
                )
                return Response.of_json({"path": path, "type": "save_weights_for_sampler"})
            path = f"tinker://{model_id}/weights/{name}"
            if path in self.state.checkpoints and not body.get("overwrite"):
                raise ValueError(f"checkpoint '{path}' exists; pass overwrite=True or pick another name")
            blob = await model.trainer.save()
            ttl = body.get("ttl_seconds")
            expires = time.monotonic() + float(ttl) if ttl else None
            self.state.checkpoints[path] = Checkpoint(
                path, model.base_model, model.rank, blob, list(model.lineage), model.lora, expires
            )
            return Response.of_json({"path": path, "type": "save_weights"})

        op = "save_weights_for_sampler" if for_sampler else "save_weights"
        return self._submit(op, model_id, body.get("seq_id"), work)

    # -- sampling --------------------------------------------------------------------------

    async def sampler_for_path(self, path: str) -> tuple[Any, str]:
        ckpt = self._checkpoint(path)
        if "/sampler_weights/" in path:
            return ckpt.blob, ckpt.base_model
        if ckpt.sampler is None:  # made once, kept (with the model it needs) as long as the checkpoint
            ckpt.trainer = await self.compute.create(self.names.computed_by(ckpt.base_model), ckpt.lora)
            await ckpt.trainer.load(ckpt.blob, optimizer=False)
            ckpt.sampler = await ckpt.trainer.sampler()
        return ckpt.sampler, ckpt.base_model

    def sample(self, body: dict[str, Any]) -> tuple[FutureRec, int]:
        sid, n = body.get("sampling_session_id"), int(body.get("num_samples", 1))
        key = sid or "base"
        old = self.state.existing(key, body.get("seq_id"))
        if old is EXPIRED:
            raise _expired(key, body.get("seq_id"))
        if old is not None:
            self.state.event("dedup", op="sample", model_id=key, seq_id=body.get("seq_id"), request_id=old.request_id)
            return old, n
        if sid is not None:
            session = self.state.samplers.get(sid)
            if session is None:
                raise ClientError(
                    404, f"unknown sampling session '{sid}' (never created, or evicted after knob session_ttl_s unused)"
                )
            session.last_used = time.monotonic()
            self.state.touch(sid)
        prompt = [int(t) for chunk in body["prompt"]["chunks"] for t in chunk["tokens"]]
        spec = sample_spec(body.get("sampling_params") or {})
        want_prompt, topk, last_n = prompt_logprob_options(body, len(prompt))
        base = None  # the model computing a base-model sample
        if sid is None and not body.get("model_path"):
            base = self.names.resolve(body["base_model"]) if body.get("base_model") else self.names.models[0]
        check_token_ids("the prompt", prompt, self._sample_vocab(sid, body.get("model_path"), base))
        rec = self.state.new_future("sample", key, body.get("seq_id"), self.knobs.try_again_polls)

        async def work() -> Response:
            if self.knobs.sample_latency_s:
                await asyncio.sleep(self.knobs.sample_latency_s)
            if sid is not None:
                session = self.state.samplers.get(sid)
                if session is None:
                    raise KeyError(f"unknown sampling session '{sid}'")
                sampler = session.sampler
            elif body.get("model_path"):
                sampler, _ = await self.sampler_for_path(body["model_path"])
            else:
                assert base is not None
                sampler = await self.compute.base_sampler(base)
            sequences = await sampler.sample(prompt, n, spec)
            if spec.stop_strings:
                sequences = [stop_at_strings(seq, spec.stop_strings, sampler.decode) for seq in sequences]
            if not (want_prompt or topk):
                return Response.of_proto(encode_sample_response(sequences))
            scored = await sampler.prompt_logprobs(prompt, topk)
            if last_n is not None:  # only the last N positions scored, as the service does
                unscored = len(prompt) - last_n
                scored.logprobs[:unscored] = np.nan
                if scored.topk_ids is not None and scored.topk_logprobs is not None:
                    scored.topk_ids[:unscored], scored.topk_logprobs[:unscored] = empty_topk(unscored, topk)
            top = None
            if topk and scored.topk_ids is not None and scored.topk_logprobs is not None:
                top = (scored.topk_ids, scored.topk_logprobs)
            return Response.of_proto(encode_sample_response(sequences, scored.logprobs if want_prompt else None, top))

        self._spawn(rec, work)
        return rec, n

    def _sample_vocab(self, sid: str | None, path: str | None, base: str | None) -> int | None:
        """The vocabulary of the model a sample request names, where it is known at the door."""
        if sid is not None:
            session = self.state.samplers.get(sid)
            return getattr(session.sampler, "vocab_size", None) if session else None
        if path:
            ckpt = self.state.checkpoints.get(path)
            return self.compute.vocab_size(self.names.computed_by(ckpt.base_model)) if ckpt else None
        return self.compute.vocab_size(base) if base else None


def digest_of(parts: list[str]) -> str:
    return "+".join(parts) if parts else "empty"
