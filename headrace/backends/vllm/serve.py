"""Start a vLLM OpenAI server that ``headrace run --sampler vllm --sampler-url URL`` can drive.

It serves the base model the torch learner trains (``--model``: 'tiny', a directory or a hub
name already in the local cache), with runtime LoRA loading switched on and headrace's sampling
conventions (token ids in and out, raw logprobs, no generation-config defaults)::

    python -m headrace.backends.vllm.serve --model DIR --lora-rank 8 --port 8000
    headrace run --sampler vllm --sampler-url http://127.0.0.1:8000 --model DIR --set torch.lora_rank=8

``--full-finetune`` also turns on vLLM's development endpoints (``VLLM_SERVER_DEV_MODE=1``),
through which full fine-tuning reloads the weights: only on a trusted network. Arguments after
``--`` go to vLLM's server unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(prog="python -m headrace.backends.vllm.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--lora-rank", type=int, default=8, help="the learner's torch.lora_rank (0 = full fine-tuning)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", help="the learner's torch.dtype")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="the run seed (picks the 'tiny' model's weights)")
    p.add_argument("--export-dir", default=None, help="where the 'tiny' model is written (default: a temp dir)")
    p.add_argument("--full-finetune", action="store_true", help="enable weight reloads (dev endpoints)")
    args = p.parse_args(argv)

    import tempfile

    from headrace.backends.torch import make_backend
    from headrace.backends.torch.config import TorchConfig
    from headrace.core.protocols import BackendContext

    section = TorchConfig(lora_rank=args.lora_rank, dtype=args.dtype, device="cpu")
    export_dir = Path(args.export_dir or tempfile.mkdtemp(prefix="headrace-vllm-serve-"))
    backend = make_backend(section, BackendContext(model=args.model, seed=args.seed))
    model_dir = backend.export_base_model(export_dir / "base")
    del backend

    from .server import server_command, server_env

    cmd = server_command(
        str(model_dir),
        host=args.host,
        port=args.port,
        lora_rank=args.lora_rank,
        max_loras=args.max_loras,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        extra=extra,
    )
    print("serving", model_dir, "with:", " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, server_env(full_finetune=args.full_finetune or args.lora_rank == 0))


if __name__ == "__main__":
    main()
