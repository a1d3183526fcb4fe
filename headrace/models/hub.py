"""Hugging Face hub names: the local snapshot, fetched only when the hub answers within seconds."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from .errors import ModelLoadError, first_line

PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py", "*.jinja"]


def hub_snapshot(name: str) -> str:
    """The directory of a hub model's cached (or freshly fetched) snapshot."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, local_files_only=True, allow_patterns=PATTERNS)
    except Exception:  # noqa: BLE001 - not cached: try the network below
        why = hub_unreachable()
    if why is None:
        try:
            return snapshot_download(name, allow_patterns=PATTERNS)
        except Exception as e:  # noqa: BLE001 - every hub failure gets the same advice
            why = first_line(e)
    raise ModelLoadError(
        f"could not fetch model '{name}' from the Hugging Face hub ({why}) and it is not in the local cache. "
        f"Download it where there is network (e.g. `hf download {name} --local-dir DIR`) "
        "and pass --model DIR, or use the embedded default --model tiny."
    )


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the hub cannot be reached, or None. Fails in seconds instead of minutes of retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy resolves names; let the download itself decide
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{url.hostname} is unreachable: {e.strerror or e}"
