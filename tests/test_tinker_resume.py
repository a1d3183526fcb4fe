"""The Tinker backend before it trains: the tokenizer is resolved before anything exists on the
service, and ``--resume`` starts from the run directory's checkpoint or says plainly why it
can't (a state the service no longer has)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import traced_train
from tinker_support import backend_config, emulator, ops, run_config, tinker_env  # noqa: F401

import headrace
from headrace.core.errors import ConfigError
from headrace.run.backends import make_backend
from headrace.run.train import train
from headrace.tinker_emulator import EmulatorThread, Knobs
from headrace.tokenizers.char import CharTokenizer

pytestmark = [pytest.mark.tinker, pytest.mark.timeout(120)]
HEADRACE = [sys.executable, "-c", "import sys; from headrace.app.cli import main; sys.exit(main())"]
QUICK = {"advantages.filter_constant": "false"}  # the untrained model is rarely right: constant groups still train
TOKENIZER_JSON = Path(headrace.__file__).parent / "assets" / "tokenizer.json"


def _created_nothing(emu: EmulatorThread) -> None:
    state = emu.emulator.state
    assert not state.sessions and not state.models and not ops(emu.log(), "create_model"), "remote state was created"


async def test_a_directory_holding_only_tokenizer_json_works_like_the_file(tmp_path):
    """Before: the directory failed with "the tokenizer has no EOS token" where the file worked."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(TOKENIZER_JSON.read_bytes())
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path / "run", tokenizer=str(tmp_path / "tok"))) as backend:
            assert backend.tokenizer.eos_token_id == CharTokenizer.eos_token_id
            assert backend.tokenizer.encode("12+3=") == CharTokenizer().encode("12+3=")


@pytest.mark.parametrize("kind", ["missing", "not a tokenizer", "empty directory"])
async def test_a_bad_tokenizer_fails_before_anything_is_created_on_the_service(tmp_path, kind):
    """Before: a session, a model and its first commit were created, then the tokenizer failed."""
    path = tmp_path / "tok"
    if kind == "not a tokenizer":
        path.write_text("{not json")
    elif kind == "empty directory":
        path.mkdir()
    with emulator() as emu:
        with pytest.raises(ConfigError, match="tinker.tokenizer"):
            async with make_backend(backend_config(emu.url, tmp_path / "run", tokenizer=str(path))):
                pass
        _created_nothing(emu)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # > 10 s (a subprocess, a server); CI runs it
async def test_resume_when_the_service_lost_the_state_is_one_clear_error(tmp_path):
    """Before: a raw tinker error (NotFoundError from the service; RequestFailedError from the
    emulator) with a traceback. The emulator restarted on the same address has no saved state."""
    port, run_dir = _free_port(), tmp_path / "run"
    with EmulatorThread(Knobs(), port=port) as first:
        config = run_config(first.url, run_dir, steps=2, set=QUICK)
        await train(config)
    with EmulatorThread(Knobs(), port=port) as second:
        with pytest.raises(ConfigError, match="does not have the saved state") as info:
            await train(config.model_copy(update={"resume": True}))
        message = str(info.value)
        assert "step_000002" in message and "--overwrite" in message and "answered HTTP 404 NotFoundError" in message
        assert not second.emulator.state.models  # nothing created, the session was closed
        env = {**os.environ, "TINKER_TELEMETRY": "0"}
        out = subprocess.run(
            [
                *HEADRACE,
                "run",
                "--backend",
                "tinker",
                "--tinker-url",
                second.url,
                "--steps",
                "2",
                "--resume",
                "--run-dir",
                str(run_dir),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=100,
            env=env,
        )
    assert out.returncode == 2, out.stderr
    assert "does not have the saved state" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


async def test_resume_without_a_checkpoint_starts_from_fresh_weights(tmp_path):
    """The run directory decides where a resumed run starts: with no checkpoint it starts over at
    step 0, so the backend must not load the manifest's newest state (a commit, or a checkpoint
    the run never recorded) under it. Before: it loaded that state and trained steps 0.. again on it."""
    run_dir = tmp_path / "run"
    with emulator() as emu:
        config = run_config(emu.url, run_dir, steps=3, set={**QUICK, "tinker.commit_every": 1})
        await train(config)
        for name in ("latest", "index.jsonl"):  # as if the run had died before its first checkpoint
            (run_dir / "checkpoints" / name).unlink()
        (run_dir / "metrics.jsonl").unlink()
        states = json.loads((run_dir / "tinker_manifest.json").read_text())["states"]
        assert len(states) >= 2
        summary = await traced_train(config.model_copy(update={"resume": True}))
        model = summary.backend.training.client.model_id
        info = emu.models()[model]
        log = emu.log()
    assert info["parent"] is None, "the resumed run started from a state the run directory does not continue from"
    assert ops(log, "create_model", model) and not ops(log, "load_weights", model)
    assert summary.steps == 3
