"""Checkpoints: trainable weights (safetensors), optimizer state and a small JSON header.

Written into a temporary sibling directory and renamed into place, so a crash never leaves a
half-written checkpoint under the final name. Only the trainable tensors are stored (the LoRA
adapter, or every weight for full fine-tuning); the frozen base comes from the model itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from headrace.core.errors import BackendError

FORMAT = 1
WEIGHTS, OPTIMIZER, META = "weights.safetensors", "optimizer.pt", "meta.json"


class CheckpointError(BackendError, ValueError):
    """A checkpoint that is missing, damaged, or belongs to a different model."""


def save(
    directory: Path, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, meta: dict[str, Any]
) -> Path:
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file({n: p.detach().to("cpu").contiguous() for n, p in params.items()}, str(tmp / WEIGHTS))
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        (tmp / META).write_text(json.dumps({"format": FORMAT, **meta}, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk leaves no half-written checkpoint behind
        raise
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory


def delete(directory: Path, root: Path) -> None:
    """Remove a checkpoint the run no longer keeps; only one of this backend's, under ``root``."""
    if directory.resolve().parent != root.resolve() or not (directory / META).is_file():
        raise CheckpointError(f"'{directory}' is not a checkpoint of this run (in {root}); not deleting it")
    shutil.rmtree(directory)


def read_meta(directory: Path) -> dict[str, Any]:
    path = directory / META
    if not path.is_file():
        raise CheckpointError(f"'{directory}' is not a torch-backend checkpoint (no {META})")
    return json.loads(path.read_text())


def load(
    directory: Path, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, expect: dict[str, Any]
) -> dict[str, Any]:
    """Restore weights and optimizer in place; ``expect`` lists header fields that must match."""
    meta = read_meta(directory)
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(
                f"checkpoint '{directory}' was written with {key}={meta.get(key)!r}, this run has {key}={value!r}"
            )
    weights = load_file(str(directory / WEIGHTS))
    if weights.keys() != params.keys():
        diff = sorted(weights.keys() ^ params.keys())
        raise CheckpointError(f"checkpoint '{directory}' does not match the model's parameters (e.g. {diff[0]})")
    with torch.no_grad():
        for name, p in params.items():
            if weights[name].shape != p.shape:
                raise CheckpointError(
                    f"checkpoint '{directory}': {name} has shape {tuple(weights[name].shape)}, "
                    f"the model has {tuple(p.shape)}"
                )
            p.copy_(weights[name])
    # on the CPU: load_state_dict moves each moment to its parameter's device and keeps Adam's
    # step counters where Adam wants them
    optimizer.load_state_dict(torch.load(directory / OPTIMIZER, map_location="cpu", weights_only=True))
    return meta
