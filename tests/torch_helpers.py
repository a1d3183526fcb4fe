"""Builders shared by the torch-backend tests."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from headrace.backends.torch.config import TorchConfig  # noqa: E402
from headrace.core.types import Datum, SampledTokens  # noqa: E402
from headrace.run.config import RunConfig  # noqa: E402

# HEADRACE_TEST_DEVICE=cuda runs the same tests on a GPU (fp32, so the tolerances hold)
DEVICE = os.environ.get("HEADRACE_TEST_DEVICE", "cpu")


def config(tmp_path=None, **torch_options: Any) -> RunConfig:
    fields: dict[str, Any] = {"seed": 0, "torch": TorchConfig(device=DEVICE, **torch_options)}
    if tmp_path is not None:
        fields["run_dir"] = str(tmp_path / "run")
    return RunConfig(**fields)


def datum(prompt: list[int], sample: SampledTokens, advantage: float = 1.0) -> Datum:
    """Prompt + action as one sequence; loss (and the sampler's logprobs) on the action only."""
    seq = prompt + sample.tokens
    n_prompt = len(prompt) - 1
    mask = [0.0] * n_prompt + [1.0] * len(sample.tokens)
    return Datum(
        model_input=seq[:-1],
        target_tokens=seq[1:],
        logprobs=[0.0] * n_prompt + list(sample.logprobs),
        advantages=[advantage * m for m in mask],
        mask=mask,
    )


def action_logprobs(result_logprobs: list[float], d: Datum) -> list[float]:
    n = int(sum(d.mask))
    return result_logprobs[-n:]


def grouped_llama_config():
    """A small llama whose query heads share key heads (6 over 2), as SmolLM2's do."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
