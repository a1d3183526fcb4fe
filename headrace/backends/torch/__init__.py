"""The ``torch`` backend: a local PyTorch learner (full fine-tune or PEFT LoRA) and a batched
KV-cache sampler on the same weights, CPU or CUDA, with device work on its own thread.

``--model tiny`` (the default) is a 2-layer Llama built from a config with the run seed and the
character tokenizer shipped in ``headrace/assets``: nothing is downloaded. Any other value is
a local model directory or a Hugging Face hub name (``Qwen/Qwen3-0.6B``).

Modules: ``model`` (loading), ``tokenizer`` (HF tokenizer wrapper), ``losses``, ``trainer``
(the training protocol) with ``scoring`` (targets' logprobs, the reference), ``batches``
(padded and packed layouts), ``custom`` (post-training's forward and custom loss), ``flops``,
``lora`` (PEFT's LoRA linears, fused), ``norms`` (RMSNorm with a hand-written backward),
``layers`` (the learner's Llama attention and MLP: the same forward bits, less work),
``head`` (float32 logits from bfloat16 matmuls) with ``brgemm`` (torch's bfloat16 micro-kernel
through ctypes), ``generate`` (the sampling loop),
``fast_decode`` (the sampler's module on faster, bit-identical kernels), ``sampler`` (request
batching, versions), ``weights`` (published snapshots and their export), ``checkpoint``,
``device_thread``, ``backend`` (wiring), ``config`` (the ``[torch]`` section), ``plugin`` (its
registration).

torch, transformers and peft are imported only when the backend is made, so ``import headrace``
never needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headrace.core.protocols import BackendContext

    from .backend import TorchBackend
    from .config import TorchConfig


def make_backend(config: TorchConfig, ctx: BackendContext) -> TorchBackend:
    """The backend for its ``[torch]`` section and the run's context (``plugin.py`` registers it)."""
    from .backend import TorchBackend

    return TorchBackend(config, ctx)


__all__ = ["make_backend"]
