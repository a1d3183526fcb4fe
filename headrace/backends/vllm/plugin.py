"""The vllm sampler as headrace finds it (``headrace.backends`` entry point); imports no vLLM."""

from __future__ import annotations

from headrace.core.protocols import BackendPlugin

from .config import VllmConfig

plugin = BackendPlugin(
    "vllm",
    VllmConfig,
    "headrace.backends.vllm:make_sampler",
    kind="sampler",
    description="vLLM samples for the torch learner (--sampler vllm): in process, or a server at --sampler-url",
    flags=(("--sampler-url", "sampler_url", str, "OpenAI-compatible vLLM server for --sampler vllm"),),
    requires=("httpx",),  # and vLLM itself in process (its error says how to install it), not for a server
    install="pip install 'headrace[vllm]' (CPU: see headrace/backends/vllm/README.md)",
)
