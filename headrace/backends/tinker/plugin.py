"""The tinker backend as headrace finds it (``headrace.backends`` entry point); imports no SDK."""

from __future__ import annotations

from headrace.core.protocols import BackendPlugin

from .config import TinkerConfig

plugin = BackendPlugin(
    "tinker",
    TinkerConfig,
    "headrace.backends.tinker.backend:make_backend",
    description="training and sampling on the Tinker service (or `headrace tinker-emulator`) through its SDK",
    flags=(
        ("--tinker-url", "base_url", str, "Tinker service address (default: TINKER_BASE_URL)"),
        ("--tokenizer", "tokenizer", str, "local tokenizer path for the tinker backend (no hub download)"),
    ),
    requires=("tinker", "transformers"),
    install="pip install 'headrace[tinker]'",
)
