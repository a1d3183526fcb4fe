"""Where the service is, with which key, and the tokenizer: each failure is one clear sentence.

The address comes from ``--tinker-url`` (``tinker.base_url``) or the SDK's own
``TINKER_BASE_URL``; the key from the SDK's ``TINKER_API_KEY`` (or its credentials file or
``TINKER_CREDENTIAL_CMD``). A loopback address without a key gets a placeholder key, so the
local emulator needs no setup.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from headrace.core.errors import ConfigError
from headrace.core.types import Tokenizer
from headrace.net.addresses import is_loopback
from headrace.tokenizers.hf import HFTokenizer as _EngineHFTokenizer

from .config import TinkerConfig

HOSTED = "https://tinker.thinkingmachines.dev/services/tinker-prod"
EMULATOR_KEY = "tml-local-emulator"
EMULATOR_HINT = (
    "To run offline, start the local emulator (`headrace tinker-emulator --port 8765`) and pass "
    "--tinker-url http://127.0.0.1:8765 (or set TINKER_BASE_URL)."
)


class TinkerConnectionError(ConfigError):
    """The Tinker service can't be used as configured; the message says what to set."""


def _is_loopback(url: str) -> bool:
    return is_loopback(urlparse(url).hostname or "")


def resolve(config: TinkerConfig) -> tuple[str, str | None]:
    """(base_url, api_key): the key is None when the SDK will find one itself."""
    url = (config.base_url or os.environ.get("TINKER_BASE_URL") or HOSTED).rstrip("/")
    key = os.environ.get("TINKER_API_KEY")
    if key:
        return url, key
    if _is_loopback(url):
        return url, EMULATOR_KEY
    if os.environ.get("TINKER_CREDENTIAL_CMD"):
        return url, None
    try:
        from tinker.lib.credentials import JsonCredentialStore, default_credentials_path

        if JsonCredentialStore(default_credentials_path()).get_default_key() is not None:
            return url, None
    except Exception:  # noqa: BLE001, S110 - an unreadable store is the same as none
        pass
    raise TinkerConnectionError(
        f"the tinker backend needs an API key for {url}: set TINKER_API_KEY (or run `tinker auth login`). "
        + EMULATOR_HINT
    )


async def check_reachable(url: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds, not after the SDK's five minutes of connection retries."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            await client.get(f"{url}/api/v1/healthz")
    except httpx.HTTPError as e:
        raise TinkerConnectionError(
            f"cannot reach the Tinker service at {url} ({type(e).__name__}: {e}). "
            + ("Is `headrace tinker-emulator` running on that port? " if _is_loopback(url) else "")
            + "Check --tinker-url / TINKER_BASE_URL."
        ) from None


class HFTokenizer(_EngineHFTokenizer):
    """A ``transformers`` tokenizer behind the engine's ``Tokenizer`` protocol, the same class the
    torch backend hands out (no implicit specials; the chat template), refusing one without EOS."""

    def __init__(self, hf: Any):
        if hf.eos_token_id is None:
            raise ConfigError("the tokenizer has no EOS token; a sampler could never stop on its own")
        super().__init__(hf)


EOS_SPELLINGS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>")


def local_tokenizer(path: str, what: str | None = None) -> Tokenizer:
    """A tokenizer directory, or a ``tokenizer.json`` file: never a hub download. A bare
    ``tokenizer.json`` (a file, or the only file of a directory) names no special tokens, so
    either way a missing EOS is taken from the usual spellings in its vocabulary. ``what`` names
    where the path came from in errors (default: the ``tinker.tokenizer`` setting)."""
    what = what or f"tinker.tokenizer='{path}'"
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what} does not exist; pass a tokenizer directory or tokenizer.json")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if p.is_file():
            hf = PreTrainedTokenizerFast(tokenizer_file=str(p))
        else:
            hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, JSON and Rust errors alike
        raise ConfigError(
            f"{what} is not a tokenizer transformers can load ({type(e).__name__}: {e}). Pass a "
            "directory holding tokenizer.json (and optionally tokenizer_config.json), or the tokenizer.json file."
        ) from None
    if hf.eos_token_id is None:
        hf.eos_token = next((t for t in EOS_SPELLINGS if t in hf.get_vocab()), None)
    if hf.eos_token_id is None:
        raise ConfigError(
            f"{what} names no EOS token and its vocabulary has none of {', '.join(EOS_SPELLINGS)}; "
            "a sampler could never stop on its own. Set eos_token in a tokenizer_config.json next to its "
            "tokenizer.json."
        )
    return HFTokenizer(hf)


def local_model_dir(model: str) -> Path | None:
    """The local directory of a base model headrace knows without the hub: a registered name
    (``smollm2-135m``, converted from its packaged GGUF), a model directory or a ``.gguf`` file,
    as the emulator's ``--model`` resolves them. None for 'tiny' (built in code) and for any other
    name, which only the service (or the hub) knows."""
    from headrace.models import MODELS, model_dir

    path = Path(model).expanduser()
    if model in MODELS or path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return model_dir(model)  # a registered model whose weights are missing: its ModelLoadError says how
    return None


def tokenizer_before_connecting(config: TinkerConfig, model: str) -> Tokenizer | None:
    """The tokenizer when it needs no service: ``--tokenizer PATH``, the embedded char tokenizer
    for 'tiny', or the local directory of a registered model (``smollm2-135m``) or of a model
    given by path: the very files the emulator serving it loads. Resolved before anything is
    created remotely, so a bad path costs nothing; None means the SDK's (hub) tokenizer, which
    needs the training client."""
    if config.tokenizer:
        return local_tokenizer(config.tokenizer)
    if model == "tiny":
        from headrace.tokenizers.char import CharTokenizer

        return CharTokenizer()
    directory = local_model_dir(model)
    if directory is not None:
        return local_tokenizer(str(directory), what=f"the tokenizer of model '{model}' (in '{directory}')")
    return None


def hub_tokenizer(model: str, training_client: Any) -> Tokenizer:
    """The base model's tokenizer through the SDK (a Hugging Face download)."""
    try:
        return HFTokenizer(training_client.get_tokenizer())
    except Exception as e:
        raise ConfigError(
            f"could not load the tokenizer of '{model}' through the Tinker SDK ({type(e).__name__}: {e}). "
            "It downloads from the Hugging Face Hub; offline, pass a local copy with --tokenizer PATH."
        ) from None
