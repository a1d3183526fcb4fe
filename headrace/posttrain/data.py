"""Examples from local files, as the Hugging Face ``datasets`` library loads them (JSONL, Parquet),
in the shapes the field uses: chat conversations (``{"messages": [...]}``, OpenAI's format),
``{"prompt", "completion"}`` pairs, and preference pairs (``{"prompt", "chosen", "rejected"}``,
each a string or a list of messages). Nothing is downloaded."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

from headrace.core.errors import ConfigError

Record = dict[str, Any]
Messages = list[dict[str, Any]]


def load_records(path: str | Path) -> list[Record]:
    """Every row of a JSONL (``.jsonl``/``.json``) or a Parquet (``.parquet``, through ``datasets``) file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--data '{p}' is not a file; pass a JSONL or Parquet file of examples")
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(p.suffix.lower())
    if kind is None:
        raise ConfigError(
            f"--data '{p}': the file's suffix '{p.suffix}' names no format headrace reads; use .jsonl (one JSON "
            "object a line) or .parquet"
        )
    if kind == "json":
        # read here, line by line: each row exactly as written (Arrow's schema inference, which
        # ``datasets`` uses, turns a column mixing strings and messages into one type), and a bad
        # line named by its number
        records = _read_jsonl(p)
    else:
        try:
            import datasets
        except ImportError as e:
            raise ConfigError(
                f"--data {str(path)!r} is not JSONL, and reading it needs Hugging Face's datasets package, which is "
                "not installed here: pip install 'headrace[posttrain]' (JSONL files need nothing)"
            ) from e

        datasets.disable_progress_bars()  # a bar per file read would garble the command's own output
        with tempfile.TemporaryDirectory(prefix="headrace-data-") as cache:
            try:
                rows = datasets.load_dataset(
                    kind, data_files=str(p), split="train", cache_dir=cache, keep_in_memory=True
                )
            except Exception as e:  # noqa: BLE001 - the library's own words, in one paragraph
                raise ConfigError(f"--data '{p}' could not be read as {kind} ({type(e).__name__}: {e})") from None
            records = [dict(r) for r in rows]
    if not records:
        raise ConfigError(f"--data '{p}' holds no examples")
    return records


def _read_jsonl(p: Path) -> list[Record]:
    records = []
    with p.open(encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--data '{p}' line {number} is not JSON ({e.msg}); one JSON object a line") from None
            if not isinstance(row, dict):
                raise ConfigError(f"--data '{p}' line {number} is a {type(row).__name__}, not a JSON object")
            records.append(row)
    return records


def conversation(record: Record, where: str) -> Messages:
    """An SFT example as messages: ``messages``, or ``prompt`` (a string or messages) + ``completion``."""
    if "messages" in record and record["messages"] is not None:
        return _messages(record["messages"], where)
    if "prompt" in record and "completion" in record:
        return [*_turns(record["prompt"], "user", where), *_turns(record["completion"], "assistant", where)]
    raise ConfigError(
        f"{where}: an example needs 'messages' (a list of {{role, content}}) or 'prompt' and 'completion'; "
        f"it has {sorted(record)}"
    )


def preference(record: Record, where: str) -> tuple[Messages, Messages, Messages]:
    """A DPO pair: the shared prompt's messages, then the chosen and the rejected reply's."""
    missing = [k for k in ("chosen", "rejected") if record.get(k) is None]
    if missing:
        raise ConfigError(
            f"{where}: a preference pair needs 'chosen' and 'rejected' (and 'prompt'); it lacks {', '.join(missing)}"
        )
    prompt = _turns(record["prompt"], "user", where) if record.get("prompt") is not None else []
    chosen, rejected = _turns(record["chosen"], "assistant", where), _turns(record["rejected"], "assistant", where)
    if not prompt:  # the conversational form: the prompt is the turns both replies share
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if not reply or any(m["role"] != "assistant" for m in reply):
            raise ConfigError(f"{where}: '{name}' must be the assistant's reply (a string or assistant messages)")
    return prompt, chosen, rejected


def _turns(value: Any, role: str, where: str) -> Messages:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, where)


def _messages(value: Any, where: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    out: Messages = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: each message needs a string 'role' and 'content'; got {m!r:.200}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def split(records: list[Record], fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """(train, held out): a seeded shuffle's last ``fraction`` held out (at least one when asked)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_test = min(len(records) - 1, max(1, round(len(records) * fraction))) if fraction > 0 else 0
    test = sorted(order[len(order) - n_test :]) if n_test else []
    held = set(test)
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in test]


def train_and_test(
    command: str, holds: str, data: str | None, test_data: str | None, fraction: float, seed: int
) -> tuple[list[Record], list[Record]]:
    """``command``'s (train, held-out) records: ``test_data`` when given, else a seeded split of
    ``data``; ``holds`` says what ``--data`` must hold, for the refusal when it is missing."""
    if not data:
        raise ConfigError(f"{command} needs --data FILE ({holds})")
    records = load_records(data)
    if test_data:
        return records, load_records(test_data)
    return split(records, fraction, seed)
