"""Sampler weights from the Tinker service as local PEFT adapters: the hand-off of the hybrid
topology (``--backend tinker --sampler vllm``: the service trains, a local vLLM samples) and of
``RUN_DIR/final``.

A published version is a ``save_weights_for_sampler`` path (``tinker://RUN/sampler_weights/NAME``).
Its weights come down as the service's *checkpoint archive*: ``GET
/api/v1/training_runs/{RUN}/checkpoints/sampler_weights/{NAME}/archive`` answers 302 with a
signed URL of a tar holding ``adapter_config.json`` (``r``, ``lora_alpha``) and
``adapter_model.safetensors`` (PEFT's tensor names, except the output layer's LoRA, which Tinker
calls ``model.unembed_tokens``). SDKs before 0.38 sent that request as
``RestClient.get_checkpoint_archive_url_from_tinker_path``, the call the Tinker cookbook's
``weights.download`` still makes; 0.38 dropped the method, so it is sent here through the SDK's own
client (its base URL, key, connection pool and retries), as those SDKs sent it. The archive is
unpacked with no link and no path outside its directory, and converted (``peft_adapter``): tensors
renamed in the safetensors header only (whatever their dtype, no tensor is read), and a PEFT
``adapter_config.json`` written (rank, alpha, the modules the tensors name).

Each version's adapter is kept in ``DIR/v000001`` (``RUN_DIR/adapters`` in a run directory), and
recorded, with the SHA-256 of its files, in ``tinker_manifest.json``. A version already there is
not downloaded again; its files are checked against the recorded sums first, and a mismatch is
refused (``AdapterChecksumError``). The newest ``KEEP`` versions are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tarfile
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headrace.backends.tinker.errors import service_detail
from headrace.backends.tinker.manifest import Manifest
from headrace.core.errors import BackendError, ConfigError

KEEP = 8  # adapters kept on disk (the newest versions)
FILES = ("adapter_config.json", "adapter_model.safetensors")


class AdapterChecksumError(ConfigError, BackendError):
    """An adapter on disk is not the one that was downloaded (its files' SHA-256 differ)."""


class AdapterDownloadError(BackendError, RuntimeError):
    """The service's archive could not be fetched or is not a LoRA adapter."""


@dataclass(frozen=True)
class PeftShape:
    """What a sampler reads of a ``peft.LoraConfig``: the rank (the engine's LoRA slots)."""

    r: int
    lora_alpha: float


def archive_url(rest: Any, tinker_path: str) -> str:
    """The signed URL of ``tinker_path``'s checkpoint archive, asked through the SDK's client (from
    a thread that is not the SDK's loop)."""
    import httpx
    import tinker
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

    parsed = tinker.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    where = f"/api/v1/training_runs/{parsed.training_run_id}/checkpoints/{parsed.checkpoint_id}/archive"

    async def send() -> str:
        # the service's pool for requests answered by a redirect (plain httpx, not the Rust transport)
        with rest.holder.aclient(ClientConnectionPoolType.REST_SUPPORT_REDIRECT) as client:
            try:
                await client.get(
                    where,
                    cast_to=httpx.Response,
                    options={"headers": {"accept": "application/gzip"}, "follow_redirects": False},
                )
            except tinker.APIStatusError as e:
                location = e.response.headers.get("location")
                if e.status_code == 302 and location:  # the answer: the archive is at the signed URL
                    return str(location)
                if e.status_code >= 500 or e.status_code in (408, 429):
                    raise  # retried
                raise AdapterDownloadError(
                    f"the Tinker service refused the archive of {tinker_path} (HTTP {e.status_code}: "
                    f"{service_detail(e)})"
                ) from None
        raise AdapterDownloadError(f"the Tinker service answered {where} without a redirect to the archive")

    async def with_retries() -> str:
        return await rest.holder.execute_with_retries(send)

    return rest.holder.run_coroutine_threadsafe(with_retries()).result()


def unpack(archive: Path, into: Path) -> None:
    """Extract a checkpoint archive, refusing links and paths that leave ``into``."""
    base = into.resolve()
    with tarfile.open(archive, "r:*") as tar:
        for member in tar.getmembers():
            if member.issym() or member.islnk() or not (member.isfile() or member.isdir()):
                raise AdapterDownloadError(f"the checkpoint archive holds '{member.name}', which is not a plain file")
            if not (into / member.name).resolve().is_relative_to(base):
                raise AdapterDownloadError(f"the checkpoint archive holds '{member.name}', outside its directory")
        tar.extractall(into, filter="data")


def _header(path: Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def rename_tensors(src: Path, dst: Path, rename: Any) -> list[str]:
    """``src``'s safetensors file with each tensor named ``rename(name)``: a new header in front of
    the same bytes (no tensor is read, so any dtype passes). Returns the new names."""
    header, start = _header(src)
    renamed = {(k if k == "__metadata__" else rename(k)): v for k, v in header.items()}
    if len(renamed) != len(header):
        raise AdapterDownloadError(f"renaming the tensors of '{src.name}' would merge two of them")
    blob = json.dumps(renamed, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with src.open("rb") as f, dst.open("wb") as out:
        f.seek(start)
        out.write(struct.pack("<Q", len(blob)) + blob)
        shutil.copyfileobj(f, out, 1 << 20)
    return [k for k in renamed if k != "__metadata__"]


def peft_adapter(tinker_dir: Path, out: Path, base_model: str, tied_embeddings: bool = False) -> PeftShape:
    """A Tinker adapter directory as a PEFT adapter directory vLLM and ``peft`` load."""
    config = json.loads((tinker_dir / "adapter_config.json").read_text())
    if "r" not in config or "lora_alpha" not in config:
        raise AdapterDownloadError("the checkpoint's adapter_config.json names no LoRA rank ('r') and 'lora_alpha'")
    # Tinker's name for the output layer; a model with tied embeddings has none of its own
    unembed = "model.embed_tokens" if tied_embeddings else "lm_head"

    def rename(name: str) -> str:
        return name.replace("base_model.model.model.unembed_tokens.", f"base_model.model.{unembed}.")

    out.mkdir(parents=True, exist_ok=True)
    names = rename_tensors(tinker_dir / "adapter_model.safetensors", out / "adapter_model.safetensors", rename)
    modules = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if ".lora_A." in n})
    if not modules:
        raise AdapterDownloadError("the checkpoint's adapter_model.safetensors holds no LoRA tensors (lora_A)")
    peft = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": int(config["r"]), "lora_alpha": config["lora_alpha"], "lora_dropout": 0.0, "bias": "none",
        "target_modules": modules, "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(peft, indent=1))
    return PeftShape(int(config["r"]), float(config["lora_alpha"]))


def sums(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in FILES}


class LocalAdapters:
    """The adapters of one service's versions on this machine (see the module docstring)."""

    def __init__(self, directory: Path, manifest: Manifest, rest: Any, base_model: str, rank: int, alpha: float):
        self.directory, self.manifest, self.rest, self.base_model = Path(directory), manifest, rest, base_model
        self.shape = PeftShape(rank, alpha)
        self._lock = threading.Lock()  # saves run in threads; one version is fetched once
        self.handoffs: list[dict[str, Any]] = []

    def path_of(self, version: int) -> Path:
        return self.directory / f"v{version:06d}"

    def recorded(self, version: int) -> dict[str, Any] | None:
        return self.manifest.data.get("adapters", {}).get(str(version))

    def forget_after(self, version: int) -> None:
        """Drop the adapters of versions past ``version``: a resumed run trains them again."""
        for key in [k for k in self.manifest.data.get("adapters", {}) if int(k) > version]:
            shutil.rmtree(self.path_of(int(key)), ignore_errors=True)
            self.manifest.drop_adapter(int(key))

    def check(self, version: int) -> bool:
        """Whether ``version``'s adapter is on disk as it was downloaded; refuses one that differs."""
        record, path = self.recorded(version), self.path_of(version)
        if record is None or not path.is_dir():
            return False
        try:
            found = sums(path)
        except OSError:
            found = {}
        bad = [name for name in FILES if found.get(name) != record["sha256"].get(name)]
        if bad:
            raise AdapterChecksumError(
                f"the adapter of version {version} in '{path}' is not the one downloaded from {record['tinker_path']}: "
                f"the SHA-256 of {', '.join(bad)} differs from the one recorded in {self.manifest.path}. Something "
                f"changed the file after the download. Delete '{path}' to download that version again (the service "
                "keeps its sampler weights), or restore the file."
            )
        return True

    def fetch(self, version: int, tinker_path: str) -> tuple[Path, dict[str, Any]]:
        """``version``'s PEFT adapter directory, downloaded and converted unless it is on disk."""
        with self._lock:
            path = self.path_of(version)
            if self.check(version):
                return path, {"version": version, "downloaded": False}
            shutil.rmtree(path, ignore_errors=True)
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".download-", dir=self.directory) as scratch:
                started = time.perf_counter()
                url = archive_url(self.rest, tinker_path)
                tar = Path(scratch) / "archive.tar"
                try:
                    with urllib.request.urlopen(url, timeout=600) as response, tar.open("wb") as f:  # noqa: S310
                        shutil.copyfileobj(response, f, 1 << 20)
                except OSError as e:
                    raise AdapterDownloadError(f"downloading the archive of {tinker_path} failed: {e}") from e
                downloaded = time.perf_counter()
                unpack(tar, Path(scratch) / "tinker")
                staged = Path(scratch) / "peft"
                peft_adapter(Path(scratch) / "tinker", staged, self.base_model)
                staged.rename(path)
                converted = time.perf_counter()
            self.manifest.add_adapter(version, tinker_path, str(path), sums(path))
            self._prune()
            timings = {
                "version": version, "downloaded": True, "bytes": adapter_bytes(path),
                "download_s": round(downloaded - started, 4), "convert_s": round(converted - downloaded, 4),
            }  # fmt: skip
            return path, timings

    def _prune(self) -> None:
        versions = sorted(int(k) for k in self.manifest.data.get("adapters", {}))
        for version in versions[:-KEEP]:
            shutil.rmtree(self.path_of(version), ignore_errors=True)
            self.manifest.drop_adapter(version)


def adapter_bytes(path: Path) -> int:
    return sum((path / name).stat().st_size for name in FILES)


@dataclass(eq=False)
class TinkerSamplerWeights:
    """``SamplerHandle.ref`` of a version published as sampler weights, for a local sampler: what
    ``--sampler vllm`` reads of a published version (``kind``, ``peft_config.r``, ``save(dir)``)."""

    version: int
    tinker_path: str
    adapters: LocalAdapters = field(repr=False)
    kind: str = "lora"
    handoff: dict[str, Any] = field(default_factory=dict)  # the last save's timings

    @property
    def peft_config(self) -> PeftShape:
        return self.adapters.shape

    def at(self, version: int) -> TinkerSamplerWeights:
        """The same weights published again as ``version``."""
        return TinkerSamplerWeights(version, self.tinker_path, self.adapters)

    def save(self, directory: str | Path) -> Path:
        """A PEFT adapter directory of these weights (linked to, or a copy of, the one kept on disk)."""
        source, timings = self.adapters.fetch(self.version, self.tinker_path)
        out = Path(directory)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(out)
        try:  # hard links: no copy of the weights (nothing writes to these files)
            shutil.copytree(source, out, copy_function=os.link)
        except OSError:  # another file system
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(source, out)
        self.handoff = timings
        return out
