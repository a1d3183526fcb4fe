"""The torch backend as headrace finds it (``headrace.backends`` entry point); imports no torch."""

from __future__ import annotations

from headrace.core.protocols import BackendPlugin

from .config import TorchConfig, model_defaults

plugin = BackendPlugin(
    "torch",
    TorchConfig,
    "headrace.backends.torch:make_backend",
    description="a local PyTorch learner (full or LoRA) and KV-cache sampler on the same weights, CPU or CUDA",
    requires=("torch", "transformers"),
    install="pip install 'headrace[torch]'",
    model_defaults=model_defaults,
)
