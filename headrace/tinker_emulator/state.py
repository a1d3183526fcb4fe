"""The emulator's bookkeeping: futures, sessions, models, checkpoints, sampling sessions, the
request log, and what a long-lived server forgets.

Exactly once on the server side: a training submission is keyed by ``(model_id, seq_id)``, any
POST by its ``X-Idempotency-Key``; a repeated submission (the SDK retrying after a dropped
response or a 5xx) gets the first one's future back and is logged as ``dedup``, never run again.
Once that future is evicted its key stays behind as a tombstone (until its session goes), so a
late repeat is answered ``410 expired``, never run a second time.

Every model keeps its *lineage*: the digest of each gradient step applied to the state it
descends from (inherited through save/load). A gradient applied twice shows up as a repeated
digest; tests read it from ``/emulator/models``.

Eviction (``evict``, called by the emulator's janitor task): a future ``future_grace_s`` after its
result was first fetched (or ``session_ttl_s`` after it completed, if nobody fetches it); a sampling
session unused for ``session_ttl_s``; a session finished ``future_grace_s`` ago or silent (no
heartbeat, no request) for ``session_ttl_s``, with its models, sampling sessions, futures and
the sampler weights of its models (a sampler is bound to its model); a saved state whose
``ttl_seconds`` ran out. The request log keeps the newest ``log_records`` records.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headrace.net.http import Response
from headrace.tinker_emulator.compute import Sampler, Trainer

EXPIRED: Any = object()  # ``existing()``'s answer for a key whose future was evicted


def session_of(key: str | None) -> str | None:
    """``session-3:train:0`` / ``session-3:sample:1`` → ``session-3``."""
    return key.split(":", 1)[0] if key and ":" in key else None


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
    idems: list[str] = field(default_factory=list)  # the idempotency keys its reply is cached under
    completed_at: float | None = None  # monotonic
    fetched_at: float | None = None  # monotonic, the first fetch of the result

    def finish(self, response: Response) -> None:
        self.response = response
        self.log["complete_t"] = time.time()
        self.completed_at = time.monotonic()
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
    expires_at: float | None = None  # monotonic; None = kept while the emulator runs
    sampler: Any = None  # a sampler on these weights, made on first use (with the model it runs on)
    trainer: Trainer | None = None


@dataclass
class SamplingSession:
    session_id: str
    base_model: str
    sampler: Sampler
    model_path: str | None = None
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Session:
    tags: Any = None
    created: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False


class EmulatorState:
    def __init__(self, log_path: str | Path | None = None, log_records: int = 200_000):
        self.futures: dict[str, FutureRec] = {}
        self.by_seq: dict[tuple[str, int], Any] = {}  # (model or sampling session, seq_id) -> request id | EXPIRED
        self.by_idem: dict[str, Response] = {}
        self.models: dict[str, ModelRec] = {}
        self.checkpoints: dict[str, Checkpoint] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.sessions: dict[str, Session] = {}
        self.records: deque[dict[str, Any]] = deque(maxlen=log_records)
        self.evicted: dict[str, int] = {"futures": 0, "sessions": 0, "models": 0, "samplers": 0, "checkpoints": 0}
        self.archives: dict[str, bytes] = {}  # signed-URL token -> a checkpoint's tar (the last few)
        self._ids = itertools.count(1)
        self._issued = 0
        self._log_file = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115

    def new_id(self, prefix: str) -> str:
        self._issued = next(self._ids)
        return f"{prefix}-{self._issued}"

    def add_archive(self, blob: bytes, keep: int = 8) -> str:
        """Keep ``blob`` under a fresh token; the oldest go once ``keep`` are held (a URL expires)."""
        token = hashlib.sha256(blob + self.new_id("archive").encode()).hexdigest()[:32]
        self.archives[token] = blob
        while len(self.archives) > keep:
            del self.archives[next(iter(self.archives))]
        return token

    def was_issued(self, ident: str) -> bool:
        """An id this emulator handed out (and may since have forgotten)."""
        m = re.fullmatch(r"[a-z]+-(\d+)", ident or "")
        return m is not None and 0 < int(m.group(1)) <= self._issued

    def keep_records(self, n: int) -> None:
        if n != self.records.maxlen:
            self.records = deque(self.records, maxlen=n)

    def event(self, event: str, /, **fields_: Any) -> dict[str, Any]:
        record = {"event": event, "t": time.time(), **fields_}
        self.records.append(record)
        if self._log_file is not None and event != "op":  # op records are written when complete
            self._log_file.write(json.dumps(record) + "\n")
        return record

    def write_op(self, rec: FutureRec) -> None:
        if self._log_file is not None:
            self._log_file.write(json.dumps(rec.log) + "\n")

    # -- futures ---------------------------------------------------------------------------

    def new_future(self, op: str, model_id: str | None, seq_id: int | None, try_again: int) -> FutureRec:
        rid = self.new_id("req")
        rec = FutureRec(rid, op, model_id, seq_id, time.time(), try_again)
        rec.log = self.event(
            "op",
            op=op,
            request_id=rid,
            model_id=model_id,
            seq_id=seq_id,
            submit_t=rec.submit_t,
            cycle=None,
            grid_cycle=None,
            start_t=None,
            complete_t=None,
            fetch_t=None,
            applied=False,
        )
        self.futures[rid] = rec
        if model_id is not None and seq_id is not None:
            self.by_seq[(model_id, seq_id)] = rid
        return rec

    def existing(self, model_id: str | None, seq_id: int | None) -> FutureRec | Any | None:
        """The future of an earlier submission with this key, ``EXPIRED`` if it was evicted."""
        if model_id is None or seq_id is None:
            return None
        rid = self.by_seq.get((model_id, seq_id))
        if rid is EXPIRED:
            return EXPIRED
        return self.futures.get(rid) if rid else None

    def cache_reply(self, idem: str, response: Response) -> None:
        """Cache a submission's reply under its idempotency key, for as long as its future lives
        (a reply that names no future is not cached: nothing would ever evict it)."""
        rid = json.loads(response.body).get("request_id") if response.content_type == "application/json" else None
        rec = self.futures.get(rid) if isinstance(rid, str) else None
        if rec is not None:
            rec.idems.append(idem)
            self.by_idem[idem] = response

    # -- activity --------------------------------------------------------------------------

    def touch(self, key: str | None) -> None:
        session = self.sessions.get(session_of(key) or key or "")
        if session is not None:
            session.last_seen = time.monotonic()

    def model_known(self, model_id: str) -> bool:
        """A model that exists, or whose creation has been submitted."""
        return model_id in self.models or isinstance(self.by_seq.get((model_id, 0)), str)

    # -- eviction --------------------------------------------------------------------------

    def evict(self, grace_s: float, ttl_s: float, now: float | None = None) -> list[Trainer]:
        """Forget what expired; returns the trainers of evicted models, for the caller to close."""
        now = time.monotonic() if now is None else now
        for rid, rec in list(self.futures.items()):
            if rec.fetched_at is not None and now - rec.fetched_at > grace_s:
                self._drop_future(rid)
            elif rec.fetched_at is None and rec.completed_at is not None and now - rec.completed_at > ttl_s:
                self._drop_future(rid)
        for sid, sampling in list(self.samplers.items()):
            if now - sampling.last_used > ttl_s:
                self._drop_sampler(sid)
        trainers: list[Trainer] = []
        for sid, session in list(self.sessions.items()):
            idle = now - session.last_seen
            if idle > ttl_s or (session.finished and idle > grace_s):
                trainers += self._drop_session(sid)
        for path, ckpt in list(self.checkpoints.items()):
            if ckpt.expires_at is not None and now > ckpt.expires_at:
                trainers += self._drop_checkpoint(path)
        return trainers

    def _drop_checkpoint(self, path: str) -> list[Trainer]:
        ckpt = self.checkpoints.pop(path)
        self.evicted["checkpoints"] += 1
        return [ckpt.trainer] if ckpt.trainer is not None else []

    def _drop_future(self, rid: str, tombstone: bool = True) -> None:
        rec = self.futures.pop(rid)
        self.evicted["futures"] += 1
        for idem in rec.idems:
            self.by_idem.pop(idem, None)
        key = (rec.model_id, rec.seq_id)
        if tombstone and self.by_seq.get(key) == rid:  # type: ignore[arg-type]
            self.by_seq[key] = EXPIRED  # type: ignore[index]

    def _drop_sampler(self, sid: str) -> None:
        del self.samplers[sid]
        self.evicted["samplers"] += 1

    def _drop_session(self, sid: str) -> list[Trainer]:
        del self.sessions[sid]
        self.evicted["sessions"] += 1
        mine = lambda key: session_of(key) == sid  # noqa: E731
        for rid, rec in list(self.futures.items()):
            if mine(rec.model_id):
                self._drop_future(rid, tombstone=False)
        for seq in [k for k in self.by_seq if mine(k[0])]:
            del self.by_seq[seq]
        for sampler_id in [k for k in self.samplers if mine(k)]:
            self._drop_sampler(sampler_id)
        trainers = []
        for model_id in [m for m in self.models if mine(m)]:
            trainers.append(self.models.pop(model_id).trainer)
            self.evicted["models"] += 1
            prefix = f"tinker://{model_id}/sampler_weights/"
            for path in [p for p in self.checkpoints if p.startswith(prefix)]:
                trainers += self._drop_checkpoint(path)
        return trainers

    # -- views -----------------------------------------------------------------------------

    def models_view(self) -> dict[str, Any]:
        return {
            m.model_id: {
                "base_model": m.base_model,
                "rank": m.rank,
                "steps": len(m.lineage),
                "lineage": m.lineage,
                "parent": m.parent,
            }
            for m in self.models.values()
        }

    def checkpoints_view(self) -> dict[str, Any]:
        return {
            c.path: {"base_model": c.base_model, "lineage": c.lineage, "expires": c.expires_at is not None}
            for c in self.checkpoints.values()
        }

    def stats(self) -> dict[str, Any]:
        """How much the emulator holds now (and has evicted so far): for leak checks."""
        return {
            "futures": len(self.futures),
            "by_seq": len(self.by_seq),
            "by_idem": len(self.by_idem),
            "sessions": len(self.sessions),
            "models": len(self.models),
            "samplers": len(self.samplers),
            "checkpoints": len(self.checkpoints),
            "records": len(self.records),
            "evicted": dict(self.evicted),
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
