"""The model registry: ``--model`` names, where their weights come from, their training defaults.

Shared by every backend that loads weights (the torch learner, the vLLM sampler through the torch
backend's exported directory, the Tinker emulator). Importing it needs neither torch nor
transformers; converting a GGUF or fetching a hub snapshot imports them on demand.
"""

from .conversion import cache_root, save_pretrained_dequantized
from .errors import ModelLoadError
from .registry import MODELS, PRETRAINED, TINY, ModelSpec, model_dir, model_spec

__all__ = [
    "MODELS",
    "PRETRAINED",
    "TINY",
    "ModelLoadError",
    "ModelSpec",
    "cache_root",
    "model_dir",
    "model_spec",
    "save_pretrained_dequantized",
]
