"""Sampler weights from the Tinker service as local PEFT adapters (``backends/tinker/adapters.py``):
the checkpoint archive the emulator serves (a tar in the service's format), fetched through the
real SDK, converted, loaded with ``peft`` and scored as the emulator scores; kept on disk by
version, checked against its SHA-256; unsafe archives refused. No vLLM here (see
``test_serve_hybrid.py``)."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from pathlib import Path

import pytest
from tinker_support import tinker_env  # noqa: F401

from headrace.backends.tinker.adapters import AdapterChecksumError, AdapterDownloadError, rename_tensors, unpack
from headrace.core.types import AdamParams, Datum, LossSpec

TOKENS = [1, 5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from headrace.backends.vllm.models import save_random_llama

    return str(save_random_llama(tmp_path_factory.mktemp("model"), "tiny", seed=0, initializer_range=0.3))


def _peft_logprobs(model_dir: str, adapter: Path) -> list[float]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter))
    with torch.no_grad():
        logp = model(torch.tensor([TOKENS[:-1]])).logits[0].log_softmax(-1)
    return logp.gather(-1, torch.tensor(TOKENS[1:])[:, None]).squeeze(-1).tolist()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_published_version_downloads_as_a_peft_adapter_that_scores_as_the_service(tmp_path, model_dir):
    from headrace.run.backends import make_backend
    from headrace.run.config import RunConfig
    from headrace.tinker_emulator import EmulatorThread

    async def run(url: str) -> None:
        config = RunConfig(backend="tinker", model=model_dir, run_dir=str(tmp_path / "run"),
                           tinker={"base_url": url, "lora_rank": 8})  # fmt: skip
        backend = make_backend(config)
        backend.sample_locally(tmp_path / "run" / "adapters")
        async with backend:
            n = len(TOKENS) - 1
            trained = Datum(TOKENS[:-1], TOKENS[1:], [0.0] * n, [1.0] * n, [1.0] * n)
            fb = backend.training.forward_backward([trained], LossSpec("importance_sampling"))
            step = backend.training.optim_step(AdamParams(learning_rate=0.05))
            await fb, await step
            handle = await backend.training.publish(1)
            assert "/sampler_weights/" in handle.ref.tinker_path and handle.ref.peft_config.r == 8
            out = await asyncio.to_thread(handle.ref.save, tmp_path / "peft")
            assert handle.ref.handoff["downloaded"] is True
            config_json = json.loads((out / "adapter_config.json").read_text())
            assert config_json["peft_type"] == "LORA" and "lm_head" in config_json["target_modules"]
            scored = await backend.training.forward([Datum(TOKENS[:-1], TOKENS[1:], [0.0] * n, [0.0] * n, [0.0] * n)])
            ours = await asyncio.to_thread(_peft_logprobs, model_dir, out)
            assert max(abs(a - b) for a, b in zip(ours, scored[0], strict=True)) < 1e-4  # measured ~2e-6
            # kept by version: the second save is a copy of the one on disk, checked first
            await asyncio.to_thread(handle.ref.save, tmp_path / "again")
            assert handle.ref.handoff == {"version": 1, "downloaded": False}
            kept = tmp_path / "run" / "adapters" / "v000001" / "adapter_model.safetensors"
            kept.write_bytes(kept.read_bytes()[:-1] + b"\0")
            with pytest.raises(AdapterChecksumError, match="is not the one downloaded") as refused:
                await asyncio.to_thread(handle.ref.save, tmp_path / "third")
            assert "adapter_model.safetensors" in str(refused.value) and "Delete" in str(refused.value)

    with EmulatorThread(compute="torch", models=[model_dir], dtype="float32") as emu:
        asyncio.run(run(emu.url))
        assert any(r["event"] == "archive" for r in emu.log())


def _tar(tmp_path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w") as tar:
        tar.addfile(member, io.BytesIO(data) if data else None)
    return path


def test_an_archive_with_a_link_or_a_path_outside_is_refused(tmp_path):
    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(AdapterDownloadError, match="not a plain file"):
        unpack(_tar(tmp_path, link), tmp_path / "out")
    escape = tarfile.TarInfo("../escape.json")
    escape.size = 2
    with pytest.raises(AdapterDownloadError, match="outside its directory"):
        unpack(_tar(tmp_path, escape, b"{}"), tmp_path / "out2")
    assert not (tmp_path / "escape.json").exists()


def test_renaming_rewrites_the_header_only(tmp_path):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = {"base_model.model.model.unembed_tokens.lora_A.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
               "x.lora_B.weight": np.ones((3, 1), dtype=np.float16)}  # fmt: skip
    save_file(tensors, str(tmp_path / "in.safetensors"), metadata={"format": "pt"})
    names = rename_tensors(tmp_path / "in.safetensors", tmp_path / "out.safetensors", lambda n: n.replace("x.", "y."))
    assert sorted(names) == ["base_model.model.model.unembed_tokens.lora_A.weight", "y.lora_B.weight"]
    back = load_file(str(tmp_path / "out.safetensors"))
    assert np.array_equal(back["y.lora_B.weight"], tensors["x.lora_B.weight"])
    assert np.array_equal(back["base_model.model.model.unembed_tokens.lora_A.weight"], np.arange(6).reshape(2, 3))
