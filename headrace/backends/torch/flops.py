"""Model FLOPs utilisation: the FLOPs each phase did, counted from the model's shape and the tokens
it processed, against the device's peak measured once in the dtype in use (as TorchTitan and
Megatron report MFU).

Counted per token (``P``: the parameters of every matmul but the LM head, LoRA's included;
``L`` layers; ``A`` = heads x head dim; ``c``: the keys the token attends to; ``d`` x ``V`` the
head): forward ``2P + 4LAc``, plus ``2dV`` where the head runs. Backward: the activation
gradients cost the forward again (``2P + 8LAc``: attention's backward is twice its forward), the
weight gradients ``2`` x the trainable matmul parameters (all of ``P`` in full fine-tuning, the
adapters' alone with LoRA), and the head's backward only at the loss positions.

The peak: a square matmul of the model's dtype on the device, the best of a few, cached per
machine under ``~/.cache/headrace/peak_flops.json`` (device name, dtype, threads, torch version).
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")

PROBE_SIZE = 1024


@dataclass(frozen=True)
class ModelShape:
    matmul_params: int  # every nn.Linear's weight but the LM head's (LoRA's adapters included)
    trainable_matmul_params: int  # those of them the optimizer updates
    layers: int
    attention_width: int  # heads x head dim (the width of Q, and of the attention output)
    hidden: int
    vocab: int
    head_trainable: bool

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        get_base = getattr(model, "get_base_model", None)
        base: Any = get_base() if get_base is not None else model
        config = base.config
        head = base.get_output_embeddings()
        params = trainable = 0
        for module in model.modules():
            if isinstance(module, nn.Linear) and module is not head:
                params += module.weight.numel()
                trainable += module.weight.numel() if module.weight.requires_grad else 0
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(
            matmul_params=params,
            trainable_matmul_params=trainable,
            layers=int(config.num_hidden_layers),
            attention_width=heads * head_dim,
            hidden=int(config.hidden_size),
            vocab=int(head.weight.shape[0]) if head is not None else int(config.vocab_size),
            head_trainable=bool(head is not None and head.weight.requires_grad),
        )

    def forward(self, tokens: int, attended: int, head_rows: int) -> float:
        """``tokens`` through the body, ``attended`` (token, key) pairs, the head on ``head_rows``."""
        return (
            2.0 * self.matmul_params * tokens
            + 4.0 * self.layers * self.attention_width * attended
            + (2.0 * self.hidden * self.vocab * head_rows)
        )

    def backward(self, tokens: int, attended: int, loss_rows: int) -> float:
        activations = 2.0 * self.matmul_params * tokens + 8.0 * self.layers * self.attention_width * attended
        weights = 2.0 * self.trainable_matmul_params * tokens
        head = 2.0 * self.hidden * self.vocab * loss_rows * (2 if self.head_trainable else 1)
        return activations + weights + head


def causal_pairs(rows: int, length: int) -> int:
    """(token, key) pairs of a causal pass over ``rows`` sequences of ``length`` (padding included)."""
    return rows * length * (length + 1) // 2


def train_flops(shape: ModelShape, batch: dict[str, Any], backward: bool, head_everywhere: bool) -> tuple[float, int]:
    """A training pass's FLOPs and the tokens it ran: the body over every position of the batch
    (padding included: it is computed; a shared-prefix batch: the tree's rows), attention over
    each row's causal pairs (a packed row's datums attend within themselves only, so theirs; a
    tree's slots, what its mask allows), the head at every real position (``head_everywhere``: a
    model whose head runs on all) and, backward, at the loss positions."""
    rows, length = batch["input"].shape
    tokens = rows * length
    if "tree" in batch:  # shared prefixes: the body ran the tree's rows, each slot over what it may see
        tokens = batch["tree"]["input"].numel()
        pairs = int((batch["tree"]["attention_mask"] == 0).sum())
    elif "position_ids" in batch:
        pairs = sum(n * (n + 1) // 2 for _, _, n in batch["spans"])
    else:
        pairs = causal_pairs(rows, length)
    head_rows = tokens if head_everywhere else int(batch["real"].sum())
    flops = shape.forward(tokens, pairs, head_rows)
    if backward:
        flops += shape.backward(tokens, pairs, int((batch["mask"] != 0).sum()))
    return flops, tokens


@dataclass
class PerfMeter:
    """FLOPs and device seconds per phase since the last ``drain`` (the device thread adds, the
    learner's optim step drains: one row's worth), and the wall time they fell in: the sampler's
    busy fraction is its device seconds over it."""

    peak: Callable[[], float | None]  # FLOP/s; None: unknown (no MFU reported)
    flops: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    rows: dict[str, float] = field(default_factory=dict)  # rows per forward, summed
    forwards: dict[str, int] = field(default_factory=dict)
    since: float | None = None  # perf_counter at the last drain (or the first job's start)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, phase: str, flops: float = 0.0, seconds: float = 0.0, tokens: float = 0.0, rows: int = 0) -> None:
        with self._lock:
            if self.since is None:
                self.since = time.perf_counter() - seconds
            self.flops[phase] = self.flops.get(phase, 0.0) + flops
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
            self.tokens[phase] = self.tokens.get(phase, 0.0) + tokens
            if rows:
                self.rows[phase] = self.rows.get(phase, 0.0) + rows
                self.forwards[phase] = self.forwards.get(phase, 0) + 1

    def timed(self, phase: str, job: Callable[[], T]) -> Callable[[], T]:
        def run() -> T:
            start = time.perf_counter()
            with self._lock:
                if self.since is None:
                    self.since = start
            try:
                return job()
            finally:
                self.add(phase, seconds=time.perf_counter() - start)

        return run

    def drain(self) -> dict[str, float]:
        """``perf/…`` figures since the last drain; a phase that did not run reports nothing."""
        now = time.perf_counter()
        with self._lock:
            flops, seconds, tokens = self.flops, self.seconds, self.tokens
            rows, forwards = self.rows, self.forwards
            self.flops, self.seconds, self.tokens, self.rows, self.forwards = {}, {}, {}, {}, {}
            since, self.since = self.since, now
        out: dict[str, float] = {}
        peak = self.peak()
        train_s, sample_s = seconds.get("train", 0.0), seconds.get("sample", 0.0)
        if train_s > 0 and flops.get("train"):
            out["perf/train_flops_per_s"] = flops["train"] / train_s
            out["perf/train_tokens_per_s"] = tokens.get("train", 0.0) / train_s
            if peak:
                out["perf/mfu_train"] = out["perf/train_flops_per_s"] / peak
        if sample_s > 0 and (flops.get("prefill") or flops.get("decode")):
            sample_flops = flops.get("prefill", 0.0) + flops.get("decode", 0.0)
            out["perf/sample_flops_per_s"] = sample_flops / sample_s
            out["perf/sample_tokens_per_s"] = tokens.get("decode", 0.0) / sample_s
            out["perf/prefill_flops"] = flops.get("prefill", 0.0)
            out["perf/decode_flops"] = flops.get("decode", 0.0)
            if peak:
                out["perf/mfu_sample"] = out["perf/sample_flops_per_s"] / peak
            if forwards.get("decode"):
                out["perf/decode_rows"] = rows["decode"] / forwards["decode"]  # the decode batch's mean size
        if seconds and since is not None and now > since:
            # the fraction of wall time the decode loop had work and the device ran it
            out["perf/sampler_busy"] = min(1.0, sample_s / (now - since))
        if out:
            out["perf/train_s"], out["perf/sample_s"] = train_s, sample_s
            if peak:
                out["perf/peak_flops_per_s"] = peak
        return out


# ---- the device's peak -----------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "headrace" / "peak_flops.json"


def probe_peak(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of a ``size`` x ``size`` matmul in ``dtype`` on ``device``, the best of ``repeats``."""
    size = size or PROBE_SIZE
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        (a @ b).sum().item()
        if i:  # the first is a warm-up
            best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype, path: Path | None = None) -> float:
    """The device's peak in ``dtype``, probed once per machine and cached."""
    threads = torch.get_num_threads()
    key = f"{device_name(device)} | {device.type} | {dtype} | threads={threads} | torch {torch.__version__}"
    value = remembered(path or cache_path(), key, (int, float), lambda: probe_peak(device, dtype))
    return float(value)


def remembered(path: Path, key: str, kinds: tuple[type, ...], compute: Callable[[], Any]) -> Any:
    """``key``'s value in the JSON file ``path`` where it holds one of ``kinds``, else ``compute()``
    written there (atomically: runs side by side each see a whole file) and returned."""
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached, dict) and isinstance(cached.get(key), kinds):
        return cached[key]
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cached = cached if isinstance(cached, dict) else {}
        cached[key] = value
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: computed again next run
    return value
