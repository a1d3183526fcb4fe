"""The emulator's bookkeeping: futures, models, checkpoints, sampling sessions, the request log.

Exactly once on the server side: a training submission is keyed by ``(model_id, seq_id)``, any
POST by its ``X-Idempotency-Key``; a repeated submission (the SDK retrying after a dropped
response or a 5xx) gets the first one's future back and is logged as ``dedup``, never run again.

Every model keeps its *lineage*: the digest of each gradient step applied to the state it
descends from (inherited through save/load). A gradient applied twice shows up as a repeated
digest; tests read it from ``/emulator/models``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headrace.backends.tinker_emulator.compute import Sampler, Trainer
from headrace.backends.tinker_emulator.http import Response


@dataclass
class FutureRec:
    request_id: str
    op: str
    model_id: str | None
    seq_id: int | None
    submit_t: float
    try_again_left: int
    done: asyncio.Event = field(default_factory=asyncio.Event)
    response: Response | None = None
    log: dict[str, Any] = field(default_factory=dict)

    def finish(self, response: Response) -> None:
        self.response = response
        self.log["complete_t"] = time.time()
        self.done.set()


@dataclass
class ModelRec:
    model_id: str
    base_model: str
    rank: int
    trainer: Trainer
    lineage: list[str] = field(default_factory=list)  # one digest per applied optim step
    pending: list[str] = field(default_factory=list)  # digests of forward_backward since the last step
    parent: str | None = None  # the checkpoint it was loaded from
    lora: dict[str, Any] = field(default_factory=dict)  # rank, seed, train_*: a load must reuse them


@dataclass
class Checkpoint:
    path: str
    base_model: str
    rank: int
    blob: Any
    lineage: list[str]
    lora: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingSession:
    session_id: str
    base_model: str
    sampler: Sampler
    model_path: str | None = None


class EmulatorState:
    def __init__(self, log_path: str | Path | None = None):
        self.futures: dict[str, FutureRec] = {}
        self.by_seq: dict[tuple[str, int], str] = {}  # (model or sampling session, seq_id) -> request id
        self.by_idem: dict[str, Response] = {}
        self.models: dict[str, ModelRec] = {}
        self.checkpoints: dict[str, Checkpoint] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.sessions: dict[str, dict[str, Any]] = {}
        self.records: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._log_file = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def event(self, event: str, /, **fields_: Any) -> dict[str, Any]:
        record = {"event": event, "t": time.time(), **fields_}
        self.records.append(record)
        if self._log_file is not None and event != "op":  # op records are written when complete
            self._log_file.write(json.dumps(record) + "\n")
        return record

    def write_op(self, rec: FutureRec) -> None:
        if self._log_file is not None:
            self._log_file.write(json.dumps(rec.log) + "\n")

    def new_future(self, op: str, model_id: str | None, seq_id: int | None, try_again: int) -> FutureRec:
        rid = self.new_id("req")
        rec = FutureRec(rid, op, model_id, seq_id, time.time(), try_again)
        rec.log = self.event(
            "op", op=op, request_id=rid, model_id=model_id, seq_id=seq_id,
            submit_t=rec.submit_t, cycle=None, start_t=None, complete_t=None, fetch_t=None, applied=False,
        )
        self.futures[rid] = rec
        if model_id is not None and seq_id is not None:
            self.by_seq[(model_id, seq_id)] = rid
        return rec

    def existing(self, model_id: str | None, seq_id: int | None) -> FutureRec | None:
        if model_id is None or seq_id is None:
            return None
        rid = self.by_seq.get((model_id, seq_id))
        return self.futures.get(rid) if rid else None

    def models_view(self) -> dict[str, Any]:
        return {
            m.model_id: {"base_model": m.base_model, "rank": m.rank, "steps": len(m.lineage),
                         "lineage": m.lineage, "parent": m.parent}
            for m in self.models.values()
        }

    def close(self) -> None:
        if self._log_file is not None:
            self._log_file.close()


def digest(data: list[Any]) -> str:
    h = hashlib.sha256()
    for d in data:
        h.update(repr(d.tokens).encode())
        for name in sorted(d.inputs):
            h.update(name.encode())
            h.update(d.inputs[name].tobytes())
    return h.hexdigest()[:16]
