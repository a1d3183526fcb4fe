"""Random Llama model directories built from a config: for tests, benchmarks and GPU checks
on machines that cannot download a model.

vLLM's CPU attention needs a head size of 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 or 512,
so these models set ``head_dim`` explicitly (the embedded ``tiny`` model must do the same to run
on vLLM on CPU).

    python -m headrace.backends.vllm.models DIR [--preset tiny|0.5b] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.2 M parameters, the character vocabulary: a few seconds of CPU per test
    "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256},
    # ~0.49 B parameters; a 32k vocabulary (ids past the character tokenizer's decode to nothing)
    # so that the output layer costs what it does in a real model
    "0.5b": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096},
}  # fmt: skip


def save_random_llama(
    directory: str | Path,
    preset: str = "tiny",
    *,
    seed: int = 0,
    initializer_range: float = 0.02,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Write a randomly initialised ``LlamaForCausalLM`` with headrace's character tokenizer
    (config.json, model.safetensors, tokenizer files) to ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from headrace.tokenizers.char import CharTokenizer
    from headrace.tokenizers.tiny_hf import hf_tokenizer

    chars = CharTokenizer()
    shape = {"vocab_size": chars.vocab_size, **PRESETS[preset], **overrides}
    config = LlamaConfig(
        bos_token_id=chars.bos_token_id,
        eos_token_id=chars.eos_token_id,
        pad_token_id=chars.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
        **shape,
    )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    hf_tokenizer().save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--initializer-range", type=float, default=0.02)
    args = parser.parse_args(argv)
    out = save_random_llama(args.directory, args.preset, seed=args.seed, dtype=args.dtype,
                            initializer_range=args.initializer_range)  # fmt: skip
    print(out)


if __name__ == "__main__":
    main()
