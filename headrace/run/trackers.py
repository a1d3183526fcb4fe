"""Experiment trackers: each metrics row also goes to Weights & Biases and/or TensorBoard
(``headrace run --log wandb,tensorboard``; extras ``headrace[wandb]``, ``headrace[tensorboard]``).

``open_trackers`` checks names and imports before it opens anything, so a typo or a missing
package stops the run before it trains (a ``ConfigError``: exit status 2). Once the run trains, a
tracker never stops it: one that raises is reported once and sent nothing more, and closing one
that fails is reported too. The packages are imported only when asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import netrc
import numbers
import os
import secrets
import string
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol
from urllib.parse import urlparse

from headrace.core import logs
from headrace.core.errors import ConfigError, did_you_mean

log = logs.get_logger()

WANDB_ID_FILE = "wandb-run-id"  # the run's W&B id, so --resume continues the same W&B run
TENSORBOARD_DIR = "tensorboard"


class TrackedConfig(Protocol):
    """What a tracker reads of the run's config (a ``RunConfig``, which checks ``--log``'s names
    with ``check_names``: so this module does not import it)."""

    resume: bool

    def model_dump(self) -> dict[str, Any]: ...


class Tracker(Protocol):
    name: str

    def log(self, row: dict[str, Any]) -> None: ...

    def close(self, failed: bool) -> None: ...


def check_names(names: list[str]) -> list[str]:
    """The names, checked: an unknown one raises a ValueError that lists the valid names."""
    for name in names:
        if name not in TRACKERS:
            raise ValueError(
                f"unknown tracker '{name}' in --log (the `log` option); valid trackers: "
                f"{', '.join(TRACKERS)}{did_you_mean(str(name), list(TRACKERS))}. Pass a comma-separated list, "
                "e.g. --log wandb,tensorboard"
            )
    return names


@contextlib.contextmanager
def open_trackers(names: list[str], config: TrackedConfig, run_dir: Path) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Open the named trackers; yield ``track(row)``, which sends one metrics row (its step is
    ``row["step"]``) to each. They are closed when the block exits, also when it raises."""
    try:
        check_names(names)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    modules = {name: _import(name) for name in dict.fromkeys(names)}  # every import before any opening
    opened: list[Tracker] = []
    failed = True
    try:
        for name, module in modules.items():
            opened.append(TRACKERS[name][1](module, config, run_dir))
        live = list(opened)

        def track(row: dict[str, Any]) -> None:
            for tracker in list(live):
                try:
                    tracker.log(row)
                except Exception as e:  # noqa: BLE001 - a tracker must not stop the run
                    live.remove(tracker)
                    _notice(
                        f"the {tracker.name} tracker failed at step {row.get('step')} ({type(e).__name__}: {e}); "
                        "the run goes on without it (metrics.jsonl keeps every row)"
                    )

        yield track
        failed = False
    finally:
        for tracker in reversed(opened):
            try:
                tracker.close(failed)
            except Exception as e:  # noqa: BLE001 - closing a tracker must not hide the run's outcome
                _notice(f"the {tracker.name} tracker failed to close ({type(e).__name__}: {e})")


def _notice(text: str) -> None:
    log.warning("notice", text=text)
    print(f"headrace: {text}", file=sys.stderr, flush=True)


def _import(name: str) -> ModuleType:
    module = TRACKERS[name][0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.partition(".")[0]
        if isinstance(e, ModuleNotFoundError) and (e.name or "").partition(".")[0] == top:
            raise ConfigError(
                f"--log {name} needs the {top} package, which is not installed. Install it with "
                f"pip install 'headrace[{name}]', or drop {name} from --log (the `log` option)."
            ) from None
        raise ConfigError(
            f"--log {name}: the {top} package is installed but fails to import ({type(e).__name__}: {e}). "
            f"Reinstall it with pip install -U 'headrace[{name}]', or drop {name} from --log."
        ) from None


# -- Weights & Biases ------------------------------------------------------------------------
def _wandb_key_found() -> bool:
    """An API key from WANDB_API_KEY or `wandb login` (its ~/.netrc entry), without asking."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class _Wandb:
    name = "wandb"

    def __init__(self, wandb: ModuleType, config: TrackedConfig, run_dir: Path):
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if config.resume and id_file.is_file() else ""
        if not run_id:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # as wandb's
            run_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        mode = os.environ.get("WANDB_MODE")
        if not mode:
            mode = "online" if _wandb_key_found() else "offline"
            if mode == "offline":
                _notice(
                    f"wandb: no API key (WANDB_API_KEY or `wandb login`), so the run is logged offline in "
                    f"{run_dir / 'wandb'}; upload it with `wandb sync {run_dir / 'wandb'}/offline-run-*`"
                )
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "headrace",
                name=run_dir.name,
                id=run_id,
                resume="allow",  # the same id again (--resume) continues that W&B run
                dir=str(run_dir),
                config=config.model_dump(),
                mode=mode,
                # console="off": wandb must not wrap stdout/stderr under the live progress display;
                # create_new: a run the user's own code started is neither reused nor finished
                settings=wandb.Settings(console="off", reinit="create_new"),
            )
        except Exception as e:
            raise ConfigError(
                f"wandb could not start a run ({type(e).__name__}: {e}). Check `wandb login` and the network, "
                "set WANDB_MODE=offline to log locally, or drop wandb from --log."
            ) from e
        # plotted against the row's own step: after --resume re-trains steps past the last
        # checkpoint, their rows are still recorded (wandb's step= refuses a step that goes back)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict[str, Any]) -> None:
        self.run.log({key: value for key, value in row.items() if value is not None})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


# -- TensorBoard -----------------------------------------------------------------------------
class _TensorBoard:
    """Scalars through TensorBoard's own event writer (the one torch's SummaryWriter wraps), so
    the extra needs neither torch nor TensorFlow."""

    name = "tensorboard"

    def __init__(self, module: ModuleType, config: TrackedConfig, run_dir: Path):
        # by name: mypy (run without the extras) has no module to check against
        self._event = importlib.import_module("tensorboard.compat.proto.event_pb2")
        self._summary = importlib.import_module("tensorboard.compat.proto.summary_pb2")
        self._writer = module.EventFileWriter(str(run_dir / TENSORBOARD_DIR), flush_secs=5)
        self._resumed = config.resume
        self._first = True

    def log(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        if self._first and self._resumed:
            # the steps from here on are trained again: TensorBoard hides the old run's values for
            # them (what torch's SummaryWriter(purge_step=...) writes)
            self._writer.add_event(
                self._event.Event(step=step, session_log=self._event.SessionLog(status=self._event.SessionLog.START))
            )
        self._first = False
        summary = self._summary.Summary()
        for key, value in row.items():
            if key != "step" and isinstance(value, numbers.Real):
                summary.value.add(tag=key, simple_value=float(value))
        self._writer.add_event(self._event.Event(wall_time=time.time(), step=step, summary=summary))

    def close(self, failed: bool) -> None:
        self._writer.close()


# name -> (the module it imports, its opener)
TRACKERS: dict[str, tuple[str, Callable[[ModuleType, TrackedConfig, Path], Tracker]]] = {
    "wandb": ("wandb", _Wandb),
    "tensorboard": ("tensorboard.summary.writer.event_file_writer", _TensorBoard),
}
