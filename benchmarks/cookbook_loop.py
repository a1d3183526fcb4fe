"""The Tinker cookbook's own RL loop (``tinker_cookbook.rl.train.main``, tinker-cookbook 0.6.1,
unmodified) against a Tinker endpoint, for side-by-side figures with headrace on the emulator.

It trains the cookbook's arithmetic env with its ``role_colon`` renderer, 4 groups x 4 samples
and 16 tokens by default, sync or async (``AsyncConfig(max_steps_off_policy=1, loss_fn="ppo")``:
the emulator does not serve the cookbook's default async loss, ``stable_reinforce``). The tokenizer
is local, registered for the model name with the cookbook's ``tokenizer_utils.register_tokenizer``:
``smollm2`` (SmolLM2-135M's, 49,152 ids: serve it with ``--compute bigram --vocab-size 49152``
or ``--model smollm2-135m``) or ``tiny`` (the embedded model's 56 characters: ``--compute torch``).

    headrace tinker-emulator --port 8765 --compute bigram --vocab-size 49152 --clock-cycle-s 0.5 &
    python benchmarks/cookbook_loop.py --url http://127.0.0.1:8765 --mode async --steps 10

From Python (``benchmarks/tinker_clock.py``, ``tests/test_tinker_cookbook.py``)::

    from cookbook_loop import run_on_emulator, run_cookbook, cycle_figures
    with EmulatorThread(...) as emu:
        row = run_on_emulator(emu, mode="async", steps=10)   # run_cookbook + cycle_figures

The loop runs in a child process: the cookbook keeps process-wide state (its tokenizer registry,
logging setup, the pricing cache), the child can be killed at a hard timeout, and its CPU time is
the client's alone even when the emulator runs on a thread of the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

COOKBOOK_VERSION = "0.6.1"
# the Hugging Face name of the model whose tokenizer ``smollm2`` is; the emulator serves any name
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENIZERS = ("smollm2", "tiny")
TRAINING_OPS = ("forward_backward", "optim_step")


# -- figures from the emulator's request records ------------------------------------------------


def _clock(record: Mapping[str, Any]) -> int:
    # grid_cycle counts idle cycles too (the wall-clock grid); cycle only counts cycles that ran work
    grid = record.get("grid_cycle")
    return int(grid if grid is not None else record["cycle"])


def cycle_figures(
    records: Iterable[Mapping[str, Any]], steps: int | None = None, *, model_id: str | None = None
) -> dict:
    """Cycles per training step from the emulator's request records (``EmulatorThread.log()``), for
    any client: one model's ``forward_backward`` and ``optim_step`` ops in submission order, each
    step being the ``forward_backward`` ops since the previous ``optim_step`` plus its own.

    ``steps``: the steps the client ran; a different count of ``optim_step`` ops is a ValueError
    (records of another run, or a log that dropped records). ``model_id``: whose ops, needed only
    when several models trained on this emulator.

    Returns ``steps``, ``cycles_per_step`` (steady state: cycles from the first step's
    ``optim_step`` to the last's over steps - 1), ``split_steps`` (steps whose ops ran in more than
    one cycle) with their indices, ``server_step_s`` (steady state, from ``optim_step`` completion
    times), ``fb_per_step`` and ``per_step`` (each step's cycles)."""
    ops = [
        r
        for r in records
        if r.get("event", "op") == "op" and r.get("op") in TRAINING_OPS and r.get("cycle") is not None
    ]
    models = sorted({r["model_id"] for r in ops if r["op"] == "optim_step"})
    if model_id is None:
        if len(models) > 1:
            raise ValueError(
                f"the records hold the training ops of several models ({', '.join(models)}); pass model_id"
            )
        model_id = models[0] if models else None
    mine = sorted(
        (r for r in ops if r["model_id"] == model_id),
        key=lambda r: (r["seq_id"] if r.get("seq_id") is not None else float("inf"), r["submit_t"]),
    )
    per_step: list[dict[str, Any]] = []
    pending: list[Mapping[str, Any]] = []
    for r in mine:
        if r["op"] == "forward_backward":
            pending.append(r)
            continue
        cycles = [_clock(p) for p in pending] + [_clock(r)]
        per_step.append(
            {
                "fb": len(pending),
                "cycles": cycles,
                "span": max(cycles) - min(cycles) + 1,
                "optim_cycle": _clock(r),
                "optim_done_t": r.get("complete_t"),
            }
        )
        pending = []
    if steps is not None and len(per_step) != steps:
        raise ValueError(
            f"the records hold {len(per_step)} optim_step ops of model {model_id!r}, not the {steps} steps the client "
            "ran: they come from another run, or the emulator's log dropped records (raise --log-records)"
        )
    n = len(per_step)
    done = [s["optim_done_t"] for s in per_step]
    split = [i for i, s in enumerate(per_step) if s["span"] > 1]
    return {
        "model_id": model_id,
        "steps": n,
        "cycles_per_step": round((per_step[-1]["optim_cycle"] - per_step[0]["optim_cycle"]) / (n - 1), 3)
        if n > 1
        else None,
        "split_steps": len(split),
        "split_step_indices": split,
        "server_step_s": round((done[-1] - done[0]) / (n - 1), 3) if n > 1 and None not in done else None,
        "fb_per_step": [s["fb"] for s in per_step],
        "unfinished_fb": len(pending),  # forward_backward ops after the last optim_step
        "per_step": [{"fb": s["fb"], "cycles": s["cycles"]} for s in per_step],
    }


# -- running the loop ---------------------------------------------------------------------------


def run_cookbook(
    url: str,
    *,
    mode: str = "sync",
    steps: int = 10,
    groups: int = 4,
    group_size: int = 4,
    max_tokens: int = 16,
    max_steps_off_policy: int = 1,
    model_name: str = DEFAULT_MODEL,
    tokenizer: str = "smollm2",
    learning_rate: float = 1e-4,
    kl_penalty_coef: float = 0.0,
    async_loss_fn: str | None = "ppo",
    log_path: str | None = None,
    timeout_s: float = 600.0,
) -> dict:
    """Runs the cookbook's loop against ``url`` in a child process, ``steps`` steps; returns the
    run's figures: ``wall_s`` (the loop, from ``main()`` called to returned), ``mean_step_s`` (steady
    state: between the first and the last step's metrics row, over steps - 1), ``step_end_s`` (each
    row's time since ``main()`` was called), ``client_cpu_s`` and ``client_cpu_per_step_s`` (the
    child's CPU time, all of it and per step in the steady state), ``metrics`` (the cookbook's rows),
    ``model_id`` (the training model, for :func:`cycle_figures`) and ``log_path``.

    ``mode``: ``sync`` or ``async``. ``kl_penalty_coef`` > 0 adds the cookbook's KL penalty against
    the base model (prompt logprobs). ``async_loss_fn``: the async loss, ``ppo`` by default: the
    cookbook's own default, ``stable_reinforce``, is not served by the emulator (its objective is not
    published); None keeps it, for the hosted service. A failed loop raises RuntimeError with the end of its output."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', not {mode!r}")
    if tokenizer not in TOKENIZERS and not Path(tokenizer).is_dir():
        raise ValueError(
            f"tokenizer must be one of {', '.join(TOKENIZERS)} or a tokenizer directory, not {tokenizer!r}"
        )
    log_path = log_path or tempfile.mkdtemp(prefix=f"cookbook-{mode}-")
    if (Path(log_path) / "checkpoints.jsonl").exists():  # the loop would resume that run, not start one
        raise ValueError(f"{log_path} holds a cookbook run already; pass a new log_path")
    Path(log_path).mkdir(parents=True, exist_ok=True)
    spec = {
        "url": url,
        "mode": mode,
        "steps": steps,
        "groups": groups,
        "group_size": group_size,
        "max_tokens": max_tokens,
        "max_steps_off_policy": max_steps_off_policy,
        "model_name": model_name,
        "tokenizer": tokenizer,
        "learning_rate": learning_rate,
        "kl_penalty_coef": kl_penalty_coef,
        "async_loss_fn": async_loss_fn,
        "log_path": log_path,
    }
    result_path = Path(log_path) / "cookbook_loop_result.json"
    output_path = Path(log_path) / "cookbook_loop_output.log"
    env = os.environ | {"TINKER_API_KEY": os.environ.get("TINKER_API_KEY") or "tml-local", "TINKER_TELEMETRY": "0"}
    for name in ("TINKER_BASE_URL", "TINKER_CREDENTIAL_CMD"):
        env.pop(name, None)
    with output_path.open("w") as out:
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec), "--result", str(result_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout_s,
                check=False,
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"killed at the {timeout_s:.0f} s timeout"
    if rc != 0 or not result_path.exists():
        tail = output_path.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"the cookbook's {mode} loop against {url} failed ({rc}); its output ends:\n{tail}")
    return json.loads(result_path.read_text())


def run_on_emulator(emu: Any, *, steps: int = 10, **kwargs: Any) -> dict:
    """:func:`run_cookbook` against an ``EmulatorThread``, plus :func:`cycle_figures` from its
    request records (``cycles_per_step``, ``split_steps``, ...), under ``cycles``."""
    row = run_cookbook(emu.url, steps=steps, **kwargs)
    row["cycles"] = cycle_figures(emu.log(), steps, model_id=row["model_id"])
    return row


# -- the child ----------------------------------------------------------------------------------


def _tokenizer_factory(kind: str):
    def make():
        if kind == "tiny":
            from headrace.tokenizers.tiny_hf import hf_tokenizer

            return hf_tokenizer()
        from transformers import AutoTokenizer

        if kind == "smollm2":
            from headrace.models import model_dir

            return AutoTokenizer.from_pretrained(str(model_dir("smollm2-135m")))
        return AutoTokenizer.from_pretrained(kind)

    return make


class _RowWatcher:
    """Notes the wall and CPU time at which each metrics row appears in ``metrics.jsonl``: the
    loop's own step boundaries, seen from outside it (async rows carry no wall-clock time)."""

    def __init__(self, path: Path, t0: float):
        self.path, self.t0 = path, t0
        self.seen: list[tuple[float, float]] = []  # (wall since t0, process CPU s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _count(self) -> int:
        try:
            with self.path.open("rb") as f:
                return f.read().count(b"\n")
        except FileNotFoundError:
            return 0

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self._note()

    def _note(self) -> None:
        n = self._count()
        while len(self.seen) < n:
            self.seen.append((time.perf_counter() - self.t0, time.process_time()))

    def __enter__(self) -> _RowWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._note()


def _child(spec: dict[str, Any], result_path: Path) -> None:
    import asyncio

    import chz  # noqa: F401 - the cookbook's config library, imported first for a clear error if missing
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train
    from tinker_cookbook.utils import cost_estimation

    # the loop fetches a token-price list from the internet once per process; a benchmark or a
    # test makes no outside calls (the loop logs token counts only, as it does offline)
    cost_estimation._pricing_fetched = True

    model, steps = spec["model_name"], spec["steps"]
    tokenizer_utils.register_tokenizer(model, _tokenizer_factory(spec["tokenizer"]))
    extra: dict[str, Any] = {}
    if spec["kl_penalty_coef"]:
        extra["kl_penalty_coef"] = spec["kl_penalty_coef"]
        extra["kl_reference_config"] = train.KLReferenceConfig(base_model=model)
    if spec["mode"] == "async":
        loss = {"loss_fn": spec["async_loss_fn"]} if spec["async_loss_fn"] else {}
        extra["async_config"] = train.AsyncConfig(
            max_steps_off_policy=spec["max_steps_off_policy"], groups_per_batch=spec["groups"], **loss
        )
    config = train.Config(
        learning_rate=spec["learning_rate"],
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=spec["groups"],
            group_size=spec["group_size"],
            model_name_for_tokenizer=model,
            renderer_name="role_colon",
            # async samples up to max_steps_off_policy batches ahead of the step it trains
            n_batches=steps + spec["max_steps_off_policy"] + 1,
        ),
        model_name=model,
        renderer_name="role_colon",
        recipe_name="headrace_cookbook_loop",
        max_tokens=spec["max_tokens"],
        log_path=spec["log_path"],
        base_url=spec["url"],
        max_steps=steps,
        **extra,
    )
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    with _RowWatcher(Path(spec["log_path"]) / "metrics.jsonl", t0) as rows:
        asyncio.run(train.main(config))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0

    metrics = [json.loads(line) for line in (Path(spec["log_path"]) / "metrics.jsonl").read_text().splitlines()]
    step_rows = [i for i, m in enumerate(metrics) if m.get("step", -1) < steps and len(m) > 1]
    ends = [rows.seen[i] for i in step_rows if i < len(rows.seen)]
    n = len(ends)
    model_id = None
    checkpoints = Path(spec["log_path"]) / "checkpoints.jsonl"
    if checkpoints.exists():
        for line in checkpoints.read_text().splitlines():
            path = json.loads(line).get("state_path", "")  # tinker://MODEL_ID/weights/NAME
            model_id = path.removeprefix("tinker://").rsplit("/weights/", 1)[0] or model_id
    result = {
        "client": "cookbook",
        "cookbook_version": COOKBOOK_VERSION,
        "mode": spec["mode"],
        "steps": steps,
        "groups": spec["groups"],
        "group_size": spec["group_size"],
        "max_tokens": spec["max_tokens"],
        "max_steps_off_policy": spec["max_steps_off_policy"] if spec["mode"] == "async" else None,
        "wall_s": round(wall, 3),
        "mean_step_s": round((ends[-1][0] - ends[0][0]) / (n - 1), 3) if n > 1 else None,
        "step_end_s": [round(e[0], 3) for e in ends],
        "client_cpu_s": round(cpu, 3),
        "client_cpu_per_step_s": round((ends[-1][1] - ends[0][1]) / (n - 1), 3) if n > 1 else None,
        "model_id": model_id,
        "log_path": spec["log_path"],
        "metrics": metrics,
    }
    result_path.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--url", help="the Tinker endpoint, e.g. http://127.0.0.1:8765")
    parser.add_argument("--mode", default="sync", choices=["sync", "async"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-steps-off-policy", type=int, default=1)
    parser.add_argument("--model-name", default=DEFAULT_MODEL)
    parser.add_argument("--tokenizer", default="smollm2", help="smollm2, tiny or a tokenizer directory")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    if args.child:
        _child(json.loads(args.child), Path(args.result))
        return
    if not args.url:
        parser.error("--url is required")
    row = run_cookbook(
        args.url,
        mode=args.mode,
        steps=args.steps,
        groups=args.groups,
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        max_steps_off_policy=args.max_steps_off_policy,
        model_name=args.model_name,
        tokenizer=args.tokenizer,
        timeout_s=args.timeout_s,
    )
    row.pop("metrics")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
