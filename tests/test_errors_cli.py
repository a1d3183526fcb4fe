"""Errors a user sees: every failure of the real CLI is one paragraph with the right exit status
(2 usage/config, 1 run failed, 130 interrupted), and a traceback only with --debug."""

from __future__ import annotations

import errno
import subprocess
import sys
from contextlib import ExitStack

import pytest
from helpers import run_argv

from headrace import Env, GroupOf, ProblemDataset, StopCondition
from headrace.app.cli import main
from headrace.core.episode import EnvContractError
from headrace.plugins import registry
from headrace.run.config import build_config
from headrace.run.graph import Scheduler

pytestmark = pytest.mark.timeout(60)
MAX_SEED = 2**32 - 1  # the largest seed every backend takes (numpy: 0..2**32-1)


def paragraph(capsys) -> str:
    """The error paragraph: the last line of stderr, with no traceback anywhere."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def run_args(tmp_path, *extra: str, env: str = "arithmetic") -> list[str]:
    return run_argv(*extra, env=env, steps=4, group_size=2, run_dir=tmp_path / "run")


class Breaks(Env):
    def __init__(self, how):
        self.how = how

    async def initial_observation(self):
        return [5, 6], StopCondition(4)

    async def step(self, action):
        if self.how == "contract":
            raise EnvContractError("Breaks.step() broke its contract on purpose")
        raise KeyboardInterrupt


def breaking(how):
    return lambda ctx: ProblemDataset(lambda rng: GroupOf(Breaks, {"how": how}, 2), 2, 4, 0)


def raising(error: BaseException):
    def factory(ctx):
        raise error

    return factory


def failing_at_batch(n: int):
    """arithmetic, whose dataset raises an unexpected error when batch n is asked for."""

    def factory(ctx):
        inner = registry.envs.get("arithmetic")(ctx)

        class Dataset(type(inner)):
            def get_batch(self, index):
                if index >= n:
                    raise RuntimeError(f"problem server lost at batch {index}")
                return inner.get_batch(index)

        dataset = Dataset.__new__(Dataset)
        dataset.__dict__ = inner.__dict__
        return dataset

    return factory


# what a task group of the run would raise, for each env the raw-group tests use
GROUPED: dict[str, BaseException] = {
    "errors_contract": EnvContractError("Breaks.step() broke its contract on purpose"),
    "errors_interrupt": KeyboardInterrupt(),
}


RAISE: dict[str, BaseException] = {}


class RawTaskGroup(Scheduler):
    """A plugin scheduler whose wiring lets a task group's ExceptionGroup escape, once the run has
    started; inside it, the error the run's env raises (``RAISE["grouped"]``, set by the test: a
    scheduler sees no env)."""

    def lag(self):
        raise BaseExceptionGroup("unhandled errors in a TaskGroup", [RAISE["grouped"]])


class Raises(Scheduler):
    """A plugin scheduler that raises ``RAISE[name]`` (set by the test) once the run has started
    (the backend is open and the run directory written: the graph is being wired)."""

    def lag(self):
        raise RAISE["error"]


@pytest.fixture(autouse=True)
def plugins():
    """This file's envs and schedulers, registered for its tests only (`headrace envs` lists the
    registry in other tests)."""
    with ExitStack() as scope:
        for name, factory in {
            "errors_contract": breaking("contract"),
            "errors_interrupt": breaking("interrupt"),
            "errors_factory_runtime": raising(RuntimeError("cannot reach the problem server")),
            "errors_factory_interrupt": raising(KeyboardInterrupt()),
            "errors_batch_3": failing_at_batch(3),
        }.items():
            scope.enter_context(registry.envs.temporarily(name, factory))
        scope.enter_context(registry.schedulers.temporarily("errors_raw_task_group", RawTaskGroup))
        scope.enter_context(registry.schedulers.temporarily("errors_raises", Raises))
        yield


def raise_in_run(tmp_path, error: BaseException) -> int:
    RAISE["error"] = error
    return main(run_args(tmp_path, "--scheduler", "errors_raises"))


# -- usage and configuration: exit 2 ------------------------------------------------------------
def test_binary_config_file_is_one_config_error(tmp_path, capsys):
    binary = tmp_path / "model.toml"
    binary.write_bytes(b"steps = 3\n\x89PNG\r\n\x1a\n\xf0\x9f\x00\xff")
    assert main(["run", "--backend", "sim", "--config", str(binary)]) == 2
    line = paragraph(capsys)
    assert f"config file '{binary}' is not UTF-8 text" in line and "(byte 0x89 at offset 10)" in line


def test_config_file_of_many_megabytes_is_not_read(tmp_path, capsys):
    checkpoint = tmp_path / "weights.toml"
    with open(checkpoint, "wb") as f:
        f.truncate(64 * 2**20)  # sparse: no disk used
    assert main(["run", "--backend", "sim", "--config", str(checkpoint)]) == 2
    assert "is 64 MiB, not a config" in paragraph(capsys)


def test_config_file_with_a_byte_order_mark_is_read(tmp_path):
    bom = tmp_path / "run.toml"
    bom.write_bytes(b"\xef\xbb\xbfsteps = 3\n")
    assert build_config(bom).steps == 3


def test_config_file_that_is_a_directory(tmp_path, capsys):
    assert main(["run", "--backend", "sim", "--config", str(tmp_path)]) == 2
    assert "is a directory" in paragraph(capsys)


@pytest.mark.parametrize("backend", ["sim", "torch", "tinker"])
@pytest.mark.parametrize("seed", [-1, 2**32, 2**70])
def test_seed_no_backend_can_take_is_refused_before_the_run(tmp_path, capsys, backend, seed):
    argv = ["run", "--backend", backend, f"--seed={seed}", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2
    line = paragraph(capsys)
    assert f"seed: the seed must be between 0 and {MAX_SEED}" in line and f"(got {seed})" in line
    assert not (tmp_path / "run").exists()


def test_the_largest_seed_runs(tmp_path):
    assert build_config(flags={"seed": MAX_SEED}).seed == MAX_SEED
    # constant groups still train: which few sim answers are right depends on the seed
    assert main(run_args(tmp_path, "--seed", str(MAX_SEED), "--set", "advantages.filter_constant=false")) == 0


@pytest.mark.parametrize("run_dir", ["a_file/run", "a_file", "x" * 300])
def test_run_dir_that_cannot_be_made(tmp_path, capsys, run_dir):
    (tmp_path / "a_file").write_text("precious")
    args = run_args(tmp_path)
    args[args.index("--run-dir") + 1] = str(tmp_path / run_dir)
    assert main(args) == 2
    line = paragraph(capsys)
    assert line.startswith("headrace: error:") and str(tmp_path / run_dir) in line and "--run-dir" in line
    assert (tmp_path / "a_file").read_text() == "precious"


def test_read_only_run_dir(tmp_path, capsys, monkeypatch):
    import os

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(os, "mkdir", read_only)
    assert main(run_args(tmp_path)) == 2
    line = paragraph(capsys)
    assert line.startswith("headrace: error:") and "read-only" in line.lower() and str(tmp_path) in line


@pytest.mark.parametrize(
    ("error", "fragment"),
    [
        (
            FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere/problems.jsonl"),
            "cannot use '/nowhere/problems.jsonl': No such file or directory (ENOENT)",
        ),
        (
            IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp"),
            "'/tmp': Is a directory (EISDIR: a directory where a file is expected)",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "/root/x"),
            "'/root/x': Permission denied (EACCES: no permission)",
        ),
    ],
)
def test_an_os_error_about_a_path_is_a_usage_error(tmp_path, capsys, error, fragment):
    assert raise_in_run(tmp_path, error) == 2
    line = paragraph(capsys)
    assert line.startswith("headrace: error:") and fragment in line and "raised in lag (" in line


# -- a run that failed: exit 1 ------------------------------------------------------------------
def test_env_contract_error_is_one_paragraph(tmp_path, capsys):
    assert main(run_args(tmp_path, env="errors_contract")) == 1
    line = paragraph(capsys)
    assert line.startswith("headrace: run failed: Breaks.step() broke its contract on purpose.")
    assert "No step was trained" in line and str(tmp_path / "run") in line


def test_env_factory_raising_is_one_paragraph(tmp_path, capsys):
    assert main(run_args(tmp_path, env="errors_factory_runtime")) == 2
    line = paragraph(capsys)
    assert "RuntimeError: cannot reach the problem server" in line and "errors_factory_runtime" in line


def test_unexpected_error_in_a_run(tmp_path, capsys):
    assert raise_in_run(tmp_path, RuntimeError("lost the plot")) == 1
    line = paragraph(capsys)
    assert line.startswith("headrace: run failed with an unexpected error in lag (")
    assert "test_errors_cli.py:" in line and "RuntimeError: lost the plot." in line
    assert f"No step was trained; {tmp_path / 'run'} holds only the run's config" in line
    assert line.endswith("Rerun with --debug for the traceback.")


def test_unexpected_error_mid_run_says_where_the_run_directory_stands(tmp_path, capsys):
    assert main(run_args(tmp_path, "--save-every", "1", env="errors_batch_3")) == 1
    line = paragraph(capsys)
    assert "RuntimeError: problem server lost at batch 3." in line
    assert "a checkpoint after 3 steps" in line and f"--resume --run-dir {tmp_path / 'run'}" in line


def test_connection_refused_is_a_failed_run(tmp_path, capsys):
    assert raise_in_run(tmp_path, ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")) == 1
    line = paragraph(capsys)
    assert line.startswith("headrace: run failed: Connection refused (ECONNREFUSED)")


def test_disk_full_is_a_failed_run(tmp_path, capsys):
    assert raise_in_run(tmp_path, OSError(errno.ENOSPC, "No space left on device")) == 1
    line = paragraph(capsys)
    assert line.startswith("headrace: run failed:") and "No space left on device" in line
    assert "--resume" in line and "No step was trained" not in line  # said once, by the error itself


def test_an_exception_group_shows_the_error_inside(tmp_path, capsys):
    RAISE["grouped"] = GROUPED["errors_contract"]
    assert main(run_args(tmp_path, "--scheduler", "errors_raw_task_group", env="errors_contract")) == 1
    line = paragraph(capsys)
    assert "Breaks.step() broke its contract on purpose" in line and "TaskGroup" not in line


# -- interrupted: exit 130 ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "scheduler"),
    [("errors_factory_interrupt", "sync"), ("errors_interrupt", "sync"), ("errors_interrupt", "errors_raw_task_group")],
)
def test_keyboard_interrupt_exits_130(tmp_path, capsys, env, scheduler):
    if env in GROUPED:
        RAISE["grouped"] = GROUPED[env]
    assert main(run_args(tmp_path, "--scheduler", scheduler, env=env)) == 130
    assert paragraph(capsys) == "headrace: interrupted"


# -- --debug ------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_and_keeps_the_exit_status(tmp_path, capsys, where):
    RAISE["error"] = RuntimeError("lost the plot")
    args = run_args(tmp_path, "--scheduler", "errors_raises")
    assert main(["--debug", *args] if where == "before" else [*args, "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise RAISE["error"]' in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("headrace: run failed with an unexpected error") and "--debug" not in last


def test_debug_on_a_usage_error(tmp_path, capsys):
    assert main(["--debug", *run_args(tmp_path, "--seed=-1")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err


def test_other_commands_share_the_funnel(tmp_path, capsys):
    binary = tmp_path / "scenario.toml"
    binary.write_bytes(b"\xf0\x9f\x00\xff")
    assert main(["bench", "--scenario", str(binary), "--out", str(tmp_path / "out")]) == 2
    assert "is not UTF-8 text" in paragraph(capsys)


@pytest.mark.parametrize("debug", [False, True])
def test_python_m_headrace_prints_one_paragraph(tmp_path, debug):
    binary = tmp_path / "run.toml"
    binary.write_bytes(b"\x00\xff\xfe")
    cmd = [sys.executable, "-m", "headrace", *(["--debug"] if debug else []), "run", "--config", str(binary)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(f"headrace: error: config file '{binary}' is not UTF-8 text")
    assert ("Traceback" in out.stderr) == debug
    if not debug:
        assert len(out.stderr.strip().splitlines()) == 1
