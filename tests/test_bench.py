"""The benchmark harness: the ideal bound on cases with a known answer, the JSON, the errors."""

from __future__ import annotations

import json

import pytest
from helpers import run_argv

from headrace.app.cli import main
from headrace.bench.harness import merge, run_scenario
from headrace.bench.ideal import GroupWork, Work, ideal_bound
from headrace.bench.scenario import load_scenario

REQUIRED = (
    "wall_s",
    "ideal_s",
    "efficiency",
    "speedup_vs_sync",
    "steps_per_s",
    "trajectories_per_s",
    "tokens_per_s",
    "learner_busy",
    "staleness_mean",
    "staleness_max",
)


def _work(steps: int, chains: list[float], ops: list[tuple[str, float]]) -> Work:
    return Work([[GroupWork(c, c) for c in chains] for _ in range(steps)], [list(ops) for _ in range(steps)])


# -- the bound itself, on work whose answer is known by hand -------------------------------------


@pytest.mark.timeout(5)
def test_sync_ideal_is_the_sum_of_sampling_and_training():
    work = _work(5, [0.2, 0.3, 0.1], [("forward_backward", 0.25), ("optim_step", 0.05), ("publish", 0.0)])
    bound = ideal_bound(work, lag=0, minibatches=1, concurrency=64)
    assert bound.ideal_s == pytest.approx(5 * (0.3 + 0.3))
    assert bound.sampling_s == pytest.approx(1.5) and bound.training_s == pytest.approx(1.5)


@pytest.mark.timeout(5)
def test_sampling_spread_over_too_few_slots_is_work_over_concurrency():
    # 4 groups of 0.1 s on 2 slots: 0.2 s per batch, not 0.1
    work = _work(3, [0.1] * 4, [("forward_backward", 0.05), ("publish", 0.0)])
    assert ideal_bound(work, 0, 1, concurrency=2).ideal_s == pytest.approx(3 * (0.2 + 0.05))


@pytest.mark.timeout(5)
@pytest.mark.parametrize(
    ("sample", "train", "expected"),
    [
        (0.1, 0.3, 0.1 + 6 * 0.3),  # training-bound: first sampling + all training
        (0.3, 0.1, 6 * 0.3 + 0.1),  # sampling-bound: all sampling + last training
        (0.2, 0.2, 0.2 + 6 * 0.2),
    ],
)
def test_async_ideal_is_the_pipeline_bound_when_a_batch_fills_the_sampler(sample, train, expected):
    work = _work(6, [sample] * 4, [("forward_backward", train), ("publish", 0.0)])
    bound = ideal_bound(work, lag=1, minibatches=1, concurrency=4)
    assert bound.ideal_s == pytest.approx(expected)
    assert bound.ideal_s == pytest.approx(max(sample + 6 * train, 6 * sample + train))


@pytest.mark.timeout(5)
def test_async_with_spare_slots_samples_two_admitted_batches_side_by_side():
    # sampling-bound, lag 1, room for two batches: batches k and k+1 sample together after step k-1,
    # so each pair of steps costs one sampling + two trainings: (S + T) / 2 per step
    work = _work(6, [0.3] * 4, [("forward_backward", 0.1), ("publish", 0.0)])
    assert ideal_bound(work, lag=1, minibatches=1, concurrency=64).ideal_s == pytest.approx(3 * (0.3 + 0.1) + 0.1)


@pytest.mark.timeout(5)
def test_stream_starts_each_minibatch_when_its_groups_are_done():
    # chains 0.1, 0.2, 0.3, 0.4; two minibatches of two groups; fb 0.05 each, optim 0.02
    ops = [("forward_backward", 0.05), ("forward_backward", 0.05), ("optim_step", 0.02), ("publish", 0.0)]
    work = Work([[GroupWork(c, c) for c in (0.4, 0.1, 0.3, 0.2)]], [ops])
    bound = ideal_bound(work, lag=0, minibatches=2, concurrency=64)
    # fb 1 at 0.2 (second-fastest group) → 0.25; fb 2 at 0.4 → 0.45; optim → 0.47
    assert bound.ideal_s == pytest.approx(0.47)


@pytest.mark.timeout(5)
def test_clock_cycles_start_every_training_call_on_a_boundary():
    ops = [("forward_backward", 0.03), ("optim_step", 0.01), ("publish", 0.0)]
    work = _work(2, [0.12], ops)
    # step 0: sampled at 0.12 → fb 0.2–0.23, optim 0.3–0.31, publish 0.4; step 1: sampled 0.52 → fb 0.6 … publish 0.8
    assert ideal_bound(work, 0, 1, concurrency=8, clock_cycle_s=0.1).ideal_s == pytest.approx(0.8)
    # the same with the clock's boundaries shifted by 0.05
    assert ideal_bound(work, 0, 1, 8, 0.1, phase=0.05).ideal_s == pytest.approx(0.75)


@pytest.mark.timeout(5)
def test_merge_is_a_clipped_union():
    assert merge([(3, 4), (0, 1), (0.5, 2), (5, 9)], 0, 6) == [(0, 2), (3, 4), (5, 6)]


# -- the harness on a sim scenario with fixed latencies and no randomness -------------------------

FIXED = """\
backend = "sim"
env = "arithmetic"
steps = {steps}
batch_size = 4
group_size = 2
num_minibatches = 2
max_steps_off_policy = 1

[advantages]
filter_constant = false

[sim]
sample_request_s = {sample}
sample_concurrency = 4
train_step_s = {train_step}
optim_step_s = {optim}

[bench]
description = "fixed latencies"
"""


def _scenario(tmp_path, name="fixed", steps=4, sample=0.03, train_step=0.02, optim=0.01):
    path = tmp_path / f"{name}.toml"
    path.write_text(FIXED.format(steps=steps, sample=sample, train_step=train_step, optim=optim))
    return path


@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
@pytest.mark.timeout(20)
async def test_harness_ideal_and_efficiency_match_the_analytic_answer(tmp_path):
    steps, sample, train_step, optim = 4, 0.03, 0.02, 0.01
    scenario = load_scenario(str(_scenario(tmp_path, steps=steps, sample=sample, train_step=train_step, optim=optim)))
    results = {r.scheduler: r.figures for r in await run_scenario(scenario)}
    train = train_step + optim
    # sync: S + T per step; stream: two forward_backward calls per step, both after the (equal)
    # rollouts; async with lag 1 and one batch filling the 4 slots: S_0 + N·T (here S = T)
    expected = {
        "sync": steps * (sample + train),
        "stream": steps * (sample + 2 * train_step + optim),
        "async": max(sample + steps * train, steps * sample + train),
    }
    for name, ideal in expected.items():
        f = results[name]
        assert f["ideal_s"] == pytest.approx(ideal, abs=1e-6), name
        assert f["efficiency"] == pytest.approx(f["ideal_s"] / f["wall_s"])
        assert 0 < f["efficiency"] <= 1.02, (name, f)  # a lower bound: no run beats it (timer noise aside)
        assert f["sampling_s"] == pytest.approx(steps * sample, abs=1e-6)
    assert results["sync"]["speedup_vs_sync"] == 1.0
    assert results["async"]["staleness_max"] == 1 and results["sync"]["staleness_max"] == 0
    assert 0 < results["sync"]["learner_busy"] < 1


# -- the command line: JSON, PNG, errors --------------------------------------------------------


@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
@pytest.mark.timeout(30)
def test_bench_cli_writes_every_field_and_a_plot(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--scenario", str(_scenario(tmp_path, steps=2)), "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert list(data) == ["sync", "stream", "async"]
    for name, figures in data.items():
        missing = [k for k in REQUIRED if k not in figures]
        assert not missing, (name, missing)
        assert figures["ideal_s"] > 0
    assert (out / "results.png").stat().st_size > 10_000
    assert json.loads((out / "meta.json").read_text())["machine"]["nproc"] >= 1
    assert "efficiency" in capsys.readouterr().out


@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
@pytest.mark.timeout(30)
def test_overhead_bench_reports_the_floor_and_the_ratio(tmp_path):
    out = tmp_path / "out"
    args = [
        "bench",
        "--scenario",
        "overhead",
        "--schedulers",
        "async",
        "--steps",
        "3",
        "--set",
        "batch_size=4",
        "--out",
        str(out),
        "--no-plot",
    ]
    assert main(args) == 0
    figures = json.loads((out / "results.json").read_text())["async"]
    assert figures["floor_trajectories_per_s"] > 0
    assert figures["overhead_ratio"] == pytest.approx(
        figures["trajectories_per_s"] / figures["floor_trajectories_per_s"]
    )


BAD = {
    "not_toml": ("steps = = 3\n", "not valid TOML"),
    "bad_option": ("stepz = 3\n", "unknown option 'stepz'"),
    "bad_value": ("steps = -1\n", "steps"),
    "bad_bench_key": ("steps = 3\n[bench]\nschedulerz = ['sync']\n", "unknown [bench] key 'schedulerz'"),
    "bad_scheduler": ("steps = 3\n[bench]\nschedulers = ['snyc']\n", "unknown scheduler 'snyc'"),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_scenario_fails_with_one_clear_paragraph(tmp_path, capsys, case):
    text, expected = BAD[case]
    path = tmp_path / f"{case}.toml"
    path.write_text(text)
    assert main(["bench", "--scenario", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err and "\n\n" not in err.strip()
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(10)
def test_an_unknown_scenario_name_lists_the_builtins(capsys):
    assert main(["bench", "--scenario", "balancd"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'balanced'?" in err and "Traceback" not in err


@pytest.mark.timeout(10)
def test_every_builtin_scenario_loads_and_validates():
    from headrace.bench.scenario import builtin_names

    names = builtin_names()
    assert {
        "balanced",
        "sampling_bound",
        "training_bound",
        "long_tail",
        "multi_turn",
        "remote_api",
        "flaky",
        "overhead",
    } <= set(names)
    for name in names:
        load_scenario(name)


@pytest.mark.timeout(20)
def test_plot_writes_a_png_of_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        main(run_argv(run_dir=run, group_size=2, set={"advantages.filter_constant": "false"})) == 0
    )  # so a run this short trains something
    assert main(["plot", str(run)]) == 0
    assert (run / "plot.png").stat().st_size > 10_000
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.timeout(20)
def test_results_page_has_the_headline_table_the_plot_and_the_command(tmp_path):
    from headrace.bench.harness import RunResult, machine
    from headrace.bench.page import REGENERATE, Entry, write_page

    def result(name, wall, ideal, extra=None):
        figures = {
            "wall_s": wall,
            "ideal_s": ideal,
            "efficiency": ideal / wall,
            "speedup_vs_sync": 6.0 / wall,
            "staleness_mean": 0.5,
            "staleness_max": 1.0,
            "trajectories_per_s": 100.0,
        } | (extra or {})
        return RunResult(name, figures)

    balanced = Entry(
        load_scenario("balanced"), [result("sync", 6.0, 5.9), result("stream", 7.0, 6.8), result("async", 3.1, 3.0)]
    )
    overhead = Entry(
        load_scenario("overhead"),
        [
            result(
                "async",
                1.0,
                0.0,
                {"overhead_ratio": 0.1, "overhead_ratio_cpu": 0.08, "floor_trajectories_per_s": 1000.0},
            )
        ],
    )
    skipped = Entry(load_scenario("real_model"), None, "the `torch` backend is not available here.")
    page = write_page(tmp_path, [balanced, overhead, skipped], machine(), 12.0)
    text = page.read_text()
    assert REGENERATE in text and "nproc" in text
    assert "| balanced | 6.00 s | 0.86x | 1.94x | 0.98 / 0.97 / 0.97 | 0.50 / 1 |" in text
    assert "`async` 100 traj/s = 10% of the floor's 1,000 (8% per CPU second)" in text
    assert "Not run: the `torch` backend is not available here." in text
    assert (tmp_path / "headline.png").stat().st_size > 10_000
