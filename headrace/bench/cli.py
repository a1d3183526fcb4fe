"""``headrace bench``: run the schedulers on a scenario and report throughput against the ideal.

headrace bench --scenario balanced                 # all three schedulers
headrace bench --scenario my.toml --schedulers sync,async --out runs/bench/mine
headrace bench --all --out benchmarks              # every scenario + RESULTS.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

from headrace.core.errors import ConfigError
from headrace.plugins import registry


def setup(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the schedulers one after another on the same scenario and report, for each: wall time,\n"
        "steps/s, trajectories/s, tokens/s, learner and sampler busy time, staleness, the ideal bound,\n"
        "efficiency (ideal / actual) and speedup over sync. Writes DIR/results.json, DIR/meta.json and\n"
        "DIR/results.png."
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "a scenario file is a `headrace run` config (TOML, any option at the top level or in its section)\n"
        "plus a [bench] table, placed after the top-level keys:\n"
        '  backend = "sim"\n  steps = 30\n  [sim]\n  sample_token_s = 0.01\n'
        '  [bench]\n  description = "what it measures"\n  schedulers = ["sync", "async"]   # optional\n'
        "see headrace/bench/scenarios/*.toml for the built-in ones"
    )
    parser.add_argument(
        "--scenario",
        metavar="NAME_OR_FILE",
        help="a built-in scenario (see --list) or a TOML file; several, comma-separated, run in turn",
    )
    parser.add_argument(
        "--schedulers",
        metavar="LIST",
        help="comma-separated, in order (default: the scenario's, normally sync,stream,async)",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="where results go (default: runs/bench/SCENARIO; with --all: runs/bench)"
    )
    parser.add_argument(
        "--all", action="store_true", help="run every built-in scenario and write DIR/RESULTS.md and DIR/headline.png"
    )
    parser.add_argument("--list", action="store_true", help="list the built-in scenarios")
    parser.add_argument("--steps", type=int, help="override the scenario's number of steps")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any run option of the scenario",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run each scheduler N times and keep its least disturbed run (a shared machine steals seconds)",
    )
    parser.add_argument(
        "--keep-runs", action="store_true", help="keep each run's directory (metrics.jsonl, log.jsonl) under DIR/runs/"
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from headrace.bench.scenario import builtin_names, check_scheduler, load_scenario, parse_overrides

    console = Console()
    if not console.is_terminal:  # logs and CI: a wide table rather than one wrapped to 80 columns
        console = Console(width=200)
    if args.list:
        for name in builtin_names():
            console.print(f"[bold]{name}[/bold]: {load_scenario(name).description}")
        return 0
    if args.all == bool(args.scenario):
        raise ConfigError(
            "headrace bench needs --scenario NAME_OR_FILE or --all (and not both); --list shows the scenarios"
        )
    schedulers = None
    if args.schedulers:
        schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
        if not schedulers:
            raise ConfigError("--schedulers is empty; give a comma-separated list such as sync,async")
        for name in schedulers:
            check_scheduler(name)
    overrides = parse_overrides(args.overrides)
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1 (got {args.repeats})")
    if args.all:
        return _run_all(args, console, schedulers, overrides)
    names = [n.strip() for n in args.scenario.split(",") if n.strip()]
    scenarios = [load_scenario(name) for name in names]  # every name checked before anything runs
    for scenario in scenarios:
        base = Path(args.out) if args.out else Path("runs") / "bench"
        out = base / scenario.name if (len(scenarios) > 1 or not args.out) else base
        _run_and_report(scenario, schedulers, overrides, out, args, console)
    return 0


def _run_and_report(scenario, schedulers, overrides, out: Path, args, console: Console):
    from headrace.bench import report
    from headrace.bench.harness import machine, run_scenario_sync

    scenario.config(scenario.schedulers[0], "unused", overrides)  # a bad --set fails before any run
    info = machine()
    started = time.time()

    def on_start(name: str) -> None:
        console.print(f"[dim]{scenario.name}: running {name}...[/dim]")

    runs_dir = out / "runs" if args.keep_runs else None
    results = run_scenario_sync(scenario, schedulers, overrides, runs_dir, on_start, args.repeats)
    report.console_table(scenario, results, console)
    meta = {
        "machine": info,
        "overrides": overrides,
        "repeats": args.repeats,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
    }
    report.write_json(out, scenario, results, meta)
    written = [out / "results.json"]
    if not args.no_plot:
        report.plot(out / "results.png", scenario, results)
        written.append(out / "results.png")
    console.print("wrote " + ", ".join(str(p) for p in written))
    return results


def _run_all(args, console: Console, schedulers, overrides) -> int:
    from headrace.bench.harness import machine
    from headrace.bench.page import Entry, write_page
    from headrace.bench.scenario import builtin_names, load_scenario

    out = Path(args.out or Path("runs") / "bench")
    info = machine()
    started = time.perf_counter()
    entries = []
    for name in builtin_names():
        scenario = load_scenario(name)
        backend = scenario.config(scenario.schedulers[0], "unused", overrides).backend
        try:
            registry.backends.get(backend)
        except (ImportError, AttributeError) as e:
            note = f"the `{backend}` backend is not available here ({type(e).__name__}: {e})."
            console.print(f"[yellow]{name}: skipped: {note}[/yellow]")
            entries.append(Entry(scenario, None, note))
            continue
        results = _run_and_report(scenario, schedulers, overrides, out / name, args, console)
        entries.append(Entry(scenario, results))
    page = write_page(out, entries, info, time.perf_counter() - started)
    console.print(f"wrote {page} and {out / 'headline.png'}")
    return 0
