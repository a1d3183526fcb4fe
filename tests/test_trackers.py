"""`--log wandb,tensorboard`: each metrics row also goes to the real W&B SDK (offline mode) and a
real TensorBoard event file, read back with their own readers; wrong names and missing packages
stop the run before it trains; a tracker that fails mid-run is dropped, not the run."""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from headrace.app.cli import main
from headrace.core.errors import ConfigError
from headrace.run import trackers
from headrace.run.config import RunConfig, build_config
from headrace.run.trackers import TENSORBOARD_DIR, WANDB_ID_FILE, open_trackers
from headrace.run.train import train

pytest.importorskip("wandb", reason="the wandb extra: pip install 'headrace[wandb]'")
pytest.importorskip("tensorboard", reason="the tensorboard extra: pip install 'headrace[tensorboard]'")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode, with every file it writes outside the run directory kept in tmp."""
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))


def rows(steps: range, offset: float = 0.0) -> list[dict[str, Any]]:
    return [
        {"step": s, "reward/mean": s / 10 + offset, "optim/lr": 3e-4, "groups/trained": float(s), "note": "text"}
        for s in steps
    ]


# -- reading back, with each tool's own reader ---------------------------------------------------
def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: Path) -> list[Any]:
    """The records of a .wandb file, parsed with wandb's own protobuf schema. The file is a
    LevelDB-style log (32 KiB blocks of checksummed chunks after a 7-byte ':W&B' header); wandb
    0.31 ships no Python reader for it (its Go core reads it)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a wandb transaction log"
    block, header = 32768, 7
    out, pending, pos = [], b"", 7
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        pending += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def finished_records(path: Path, timeout_s: float = 10.0) -> list[Any]:
    """A finished run's records: wandb's core process may still be writing them when
    ``run.finish()`` returns in offline mode (seen: a file holding only its header)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(path)
        if records and records[-1].WhichOneof("record_type") == "exit" or time.monotonic() > deadline:
            return records
        time.sleep(0.02)


def wandb_run(run_dir: Path) -> dict[str, Any]:
    """The offline run(s) in run_dir/wandb: their ids, config and history rows."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, f"no offline wandb run under {run_dir / 'wandb'}"
    ids, history, config, exit_codes = [], [], {}, []
    for file in files:
        for record in finished_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.append(record.run.run_id)
                config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history.append({k: v for k, v in items.items() if not k.startswith("_")})
            elif kind == "exit":
                exit_codes.append(record.exit.exit_code)
    return {"ids": ids, "history": history, "config": config, "exit_codes": exit_codes, "files": files}


# -- the real trackers ------------------------------------------------------------------------------
def test_tensorboard_gets_every_numeric_value_at_its_step(tmp_path):
    sent = rows(range(5))
    sent[2]["reward/mean"] = float("nan")  # a step with no reward (every group dropped)
    sent[3]["eval/missing"] = None
    with open_trackers(["tensorboard"], RunConfig(), tmp_path) as track:
        for row in sent:
            track(row)
    scalars = tensorboard_scalars(tmp_path)
    assert sorted(scalars) == ["groups/trained", "optim/lr", "reward/mean"]  # no text, None or step
    assert [step for step, _ in scalars["reward/mean"]] == [0, 1, 2, 3, 4]
    values = [v for _, v in scalars["reward/mean"]]
    assert values[:2] == pytest.approx([0.0, 0.1]) and values[3:] == pytest.approx([0.3, 0.4])
    assert math.isnan(values[2])
    assert scalars["groups/trained"] == [(s, float(s)) for s in range(5)]


def test_tensorboard_on_resume_replaces_the_steps_trained_again(tmp_path):
    with open_trackers(["tensorboard"], RunConfig(), tmp_path) as track:
        for row in rows(range(5)):
            track(row)
    # the run died after step 4 with its last checkpoint after step 3: steps 3.. are trained again
    # event files are read in name order, and a name starts with the second it was made in
    time.sleep(1.01 - time.time() % 1)
    resumed = RunConfig(resume=True)
    with open_trackers(["tensorboard"], resumed, tmp_path) as track:
        for row in rows(range(3, 6), offset=100.0):
            track(row)
    got = tensorboard_scalars(tmp_path)["reward/mean"]
    assert [step for step, _ in got] == [0, 1, 2, 3, 4, 5]
    assert [v for _, v in got] == pytest.approx([0.0, 0.1, 0.2, 100.3, 100.4, 100.5])


@pytest.mark.slow  # > 10 s (a subprocess, a server); CI runs it
def test_wandb_offline_run_holds_the_config_and_every_row(tmp_path, wandb_offline):
    config = build_config(flags={"steps": 7, "backend": "sim", "run_dir": str(tmp_path)})
    with open_trackers(["wandb"], config, tmp_path) as track:
        for row in rows(range(4)):
            track(row)
    run = wandb_run(tmp_path)
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert run["ids"] == [run_id] and run["files"][0].name == f"run-{run_id}.wandb"
    assert run["config"]["steps"] == 7 and run["config"]["backend"] == "sim"
    assert [h["step"] for h in run["history"]] == [0, 1, 2, 3]
    assert [h["reward/mean"] for h in run["history"]] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert run["history"][1]["note"] == "text"
    assert run["exit_codes"] == [0]


def test_wandb_resume_continues_the_same_run_id(tmp_path, wandb_offline):
    with open_trackers(["wandb"], RunConfig(), tmp_path) as track:
        track(rows(range(1))[0])
    first = (tmp_path / WANDB_ID_FILE).read_text().strip()
    with open_trackers(["wandb"], RunConfig(resume=True), tmp_path) as track:
        track(rows(range(1, 2))[0])
    run = wandb_run(tmp_path)
    assert run["ids"] == [first, first], "the resumed run is a new W&B run"
    assert [h["step"] for h in run["history"]] == [0, 1]
    # a new run in the same directory (--overwrite) is a new W&B run
    with open_trackers(["wandb"], RunConfig(), tmp_path):
        pass
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() != first


def test_wandb_without_an_api_key_logs_offline_and_says_how_to_upload(tmp_path, wandb_offline, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with open_trackers(["wandb"], RunConfig(), tmp_path) as track:
        track(rows(range(1))[0])
    err = capsys.readouterr().err
    assert "no API key" in err and f"wandb sync {tmp_path / 'wandb'}/offline-run-*" in err
    assert [h["step"] for h in wandb_run(tmp_path)["history"]] == [0]


def test_a_run_that_raises_finishes_wandb_as_failed_and_closes_tensorboard(tmp_path, wandb_offline):
    with pytest.raises(RuntimeError, match="learner died"):
        with open_trackers(["wandb", "tensorboard"], RunConfig(), tmp_path) as track:
            track(rows(range(1))[0])
            raise RuntimeError("learner died")
    assert wandb_run(tmp_path)["exit_codes"] == [1]
    assert tensorboard_scalars(tmp_path)["reward/mean"] == [(0, 0.0)]


async def test_a_sim_run_sends_the_rows_of_metrics_jsonl_to_both(tmp_path, wandb_offline):
    """A run with log = wandb,tensorboard: each row written to metrics.jsonl, tracked."""
    run_dir = tmp_path / "run"
    config = build_config(
        flags={
            "backend": "sim",
            "steps": 4,
            "batch_size": 2,
            "group_size": 4,
            "run_dir": str(run_dir),
            "progress": False,
            "log": "wandb,tensorboard",
        },
        overrides=["advantages.filter_constant=false"],  # 4 short sim steps may all draw equal rewards
    )
    await train(config)
    written = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in written] == [0, 1, 2, 3]
    scalars = tensorboard_scalars(run_dir)
    history = wandb_run(run_dir)["history"]
    for key in ("time/step", "throughput/trajectories", "queue/rollout_peak"):
        assert scalars[key] == [(row["step"], pytest.approx(row[key], rel=1e-6)) for row in written], key
        assert [h[key] for h in history] == pytest.approx([row[key] for row in written]), key


# -- refusals before the run trains ----------------------------------------------------------------
def test_an_unknown_name_lists_the_valid_ones(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown tracker 'tensorbord'.*wandb, tensorboard.*did you mean 'tensorboard'"
    ):
        with open_trackers(["tensorbord"], RunConfig(), tmp_path):
            pytest.fail("opened")
    with pytest.raises(ConfigError, match="unknown tracker 'wandbb'.*did you mean 'wandb'"):
        build_config(flags={"log": "tensorboard,wandbb"})
    assert not list(tmp_path.iterdir()), "something was written for a refused tracker"


def test_log_takes_a_comma_string_or_a_list():
    assert build_config(flags={"log": " wandb, tensorboard,wandb "}).log == ["wandb", "tensorboard"]
    assert build_config(overrides=['log=["tensorboard"]']).log == ["tensorboard"]
    assert build_config().log == []


def test_cli_refuses_an_unknown_tracker_with_status_2_before_training(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["run", "--backend", "sim", "--steps", "2", "--log", "wandb,tb", "--run-dir", str(run_dir), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown tracker 'tb'" in err and "valid trackers: wandb, tensorboard" in err
    assert not run_dir.exists()


@pytest.mark.parametrize("name, module", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_a_missing_package_names_the_extra_to_install(tmp_path, monkeypatch, name, module):
    for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setitem(sys.modules, module, None)  # what `import` finds when it is not installed
    other = "tensorboard" if name == "wandb" else "wandb"
    with pytest.raises(ConfigError) as raised:
        with open_trackers([other, name], RunConfig(), tmp_path):
            pytest.fail("opened")
    assert f"pip install 'headrace[{name}]'" in str(raised.value) and "not installed" in str(raised.value)
    assert not list(tmp_path.iterdir()), "the other tracker was opened before the refusal"


# -- a tracker failing mid-run -----------------------------------------------------------------------
class Flaky:
    """Fault injection: a tracker that raises from its third row on (its package is `json`)."""

    name = "flaky"
    instances: list[Flaky] = []

    def __init__(self, module, config, run_dir, fail_close=False):
        self.got: list[int] = []
        self.closed: bool | None = None
        self.fail_close = fail_close
        Flaky.instances.append(self)

    def log(self, row):
        if len(self.got) == 2:
            raise ConnectionError("tracker service went away")
        self.got.append(row["step"])

    def close(self, failed):
        self.closed = failed
        if self.fail_close:
            raise OSError("cannot flush")


def test_a_tracker_that_raises_is_dropped_once_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    Flaky.instances.clear()
    monkeypatch.setitem(trackers.TRACKERS, "flaky", ("json", Flaky))
    with open_trackers(["flaky", "tensorboard"], RunConfig(), tmp_path) as track:
        for row in rows(range(6)):
            track(row)
    (flaky,) = Flaky.instances
    assert flaky.got == [0, 1] and flaky.closed is False
    err = capsys.readouterr().err
    assert err.count("the flaky tracker failed") == 1, err
    assert "at step 2 (ConnectionError: tracker service went away)" in err
    assert [s for s, _ in tensorboard_scalars(tmp_path)["reward/mean"]] == list(range(6))


def test_a_tracker_that_fails_to_close_does_not_fail_the_run(tmp_path, monkeypatch, capsys):
    Flaky.instances.clear()
    monkeypatch.setitem(trackers.TRACKERS, "flaky", ("json", lambda *a: Flaky(*a, fail_close=True)))
    with open_trackers(["tensorboard", "flaky"], RunConfig(), tmp_path) as track:
        track(rows(range(1))[0])
    assert "the flaky tracker failed to close (OSError: cannot flush)" in capsys.readouterr().err
    assert tensorboard_scalars(tmp_path)["reward/mean"] == [(0, 0.0)]
