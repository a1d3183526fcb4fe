"""The `checkpoint` section: checkpoint.every (--save-every), checkpoint.keep_last newest kept plus
every checkpoint.keep_every-th; local checkpoints beyond them are deleted, a backend whose states
are remote (no ``delete_state``, like Tinker's) keeps every reference (issue 10, item 13)."""

from __future__ import annotations

import json

import pytest
from helpers import run_argv, run_sim

from headrace.app.cli import main
from headrace.backends import sim
from headrace.run.config import build_config
from headrace.run.rundir import RunDir

pytestmark = pytest.mark.timeout(120)


def kept_steps(run_dir) -> list[int]:
    return [e["step"] for e in RunDir(run_dir).kept_checkpoints()]


def options(**checkpoint) -> dict:
    return {"advantages.filter_constant": "false", **{f"checkpoint.{k}": v for k, v in checkpoint.items()}}


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "kept"),
    [(3, 0, [8, 9, 10]), (3, 4, [4, 8, 9, 10]), (0, 0, list(range(1, 11)))],
)
async def test_checkpoints_beyond_keep_last_are_deleted_except_every_keep_every_th(
    tmp_path, keep_last, keep_every, kept
):
    summary = await run_sim(tmp_path, steps=10, set=options(every=1, keep_last=keep_last, keep_every=keep_every))
    assert kept_steps(tmp_path / "run") == kept
    deleted = [int(p.rsplit("=", 1)[1]) for p in summary.backend.training.deleted_states]
    assert sorted(deleted) == sorted(set(range(1, 11)) - set(kept))
    assert json.loads((tmp_path / "run" / "checkpoints" / "latest").read_text())["step"] == 10


async def test_pruning_carries_on_across_a_resume(tmp_path):
    await run_sim(tmp_path, steps=6, set=options(every=1, keep_last=2))
    assert kept_steps(tmp_path / "run") == [5, 6]
    summary = await run_sim(tmp_path, steps=9, resume=True, set=options(every=1, keep_last=2))
    assert kept_steps(tmp_path / "run") == [8, 9]
    assert [int(p.rsplit("=", 1)[1]) for p in summary.backend.training.deleted_states] == [5, 6, 7]


async def test_a_backend_with_remote_states_keeps_every_reference(tmp_path, monkeypatch):
    monkeypatch.delattr(sim.SimTraining, "delete_state")  # as the Tinker backend: nothing local to delete
    await run_sim(tmp_path, steps=6, set=options(every=1, keep_last=2))
    assert kept_steps(tmp_path / "run") == [1, 2, 3, 4, 5, 6]


def test_save_every_still_works_as_the_flag_and_in_old_config_files(tmp_path):
    assert build_config(flags={"checkpoint.every": 4}).checkpoint.every == 4
    old = tmp_path / "old.toml"
    old.write_text("save_every = 5\n")
    assert build_config(old).checkpoint.every == 5
    # a run directory written before the `checkpoint` section resumes with just its path
    run_dir = tmp_path / "D"
    assert (
        main(
            run_argv(steps=2, group_size=2, save_every=1, set={"advantages.filter_constant": "false"}, run_dir=run_dir)
        )
        == 0
    )
    saved = json.loads((run_dir / "config.json").read_text())
    saved["save_every"] = saved.pop("checkpoint")["every"]
    (run_dir / "config.json").write_text(json.dumps(saved))
    assert main(["run", "--resume", "--run-dir", str(run_dir), "--steps", "4", "--no-progress"]) == 0
    assert kept_steps(run_dir) == [2, 3, 4]  # checkpoint.keep_last defaults to 3
    assert json.loads((run_dir / "config.json").read_text())["checkpoint"]["every"] == 1


# -- the torch backend: real directories -------------------------------------------------------
def test_torch_keeps_only_the_newest_checkpoint_directories(tmp_path):
    pytest.importorskip("torch")
    run_dir = tmp_path / "D"
    assert (
        main(
            run_argv(
                backend="torch",
                steps=5,
                group_size=2,
                save_every=1,
                set={"checkpoint.keep_last": 2, "advantages.filter_constant": "false"},
                run_dir=run_dir,
            )
        )
        == 0
    )
    on_disk = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert on_disk == ["step_000004", "step_000005"]
    assert kept_steps(run_dir) == [4, 5]


def test_torch_checkpoint_that_fails_to_write_leaves_no_temp_directory(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from headrace.backends.torch import checkpoint

    layer = torch.nn.Linear(2, 2)
    params = dict(layer.named_parameters())
    optimizer = torch.optim.AdamW(layer.parameters())

    def disk_full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(RuntimeError):
        checkpoint.save(tmp_path / "step_000001", params, optimizer, {})
    assert list(tmp_path.iterdir()) == []


def test_torch_deletes_only_its_own_checkpoints(tmp_path):
    pytest.importorskip("torch")
    from headrace.backends.torch import checkpoint

    (tmp_path / "checkpoints").mkdir()
    precious = tmp_path / "precious"
    precious.mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint of this run"):
        checkpoint.delete(precious, tmp_path / "checkpoints")
    assert precious.exists()
