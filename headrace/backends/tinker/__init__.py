"""The ``tinker`` backend: training and sampling on the Tinker service through the official SDK.

``make_backend(section, ctx)`` (``backend.py``) → an async context manager with ``.training`` (LoRA training client:
``forward_backward`` / ``optim_step`` pipelined, exactly-once recovery), ``.sampling`` (one
sampling client per published version, ``num_samples=n`` per call) and ``.tokenizer``.
Needs ``pip install 'headrace[tinker]'`` and ``TINKER_API_KEY``, or a local emulator
(``headrace tinker-emulator``) at ``--tinker-url`` / ``TINKER_BASE_URL``.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module: loaded on first use, so the plugin and config modules never import the SDK
_LAZY = {
    "FILENAME": "manifest",
    "TinkerBackend": "backend",
    "make_backend": "backend",
    "TinkerNonFiniteError": "errors",
    "TinkerRecoveryError": "errors",
    "TinkerResumeError": "errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
