"""``headrace view RUN_DIR``: write one self-contained HTML page to browse the run's steps and samples."""

from __future__ import annotations

import argparse
from pathlib import Path

from headrace.viewer.page import write_page


def setup(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write a static HTML page (no network needed) to browse a run's steps, from "
        "metrics.jsonl, and the sampled completions in rollouts/."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl, rollouts/)")
    parser.add_argument("--out", metavar="FILE", help="HTML file to write (default: RUN_DIR/view.html)")
    parser.set_defaults(func=cmd_view)


def cmd_view(args: argparse.Namespace) -> int:
    out, data = write_page(Path(args.run_dir), Path(args.out) if args.out else None)
    samples = sum(len(s["samples"]) for s in data["steps"])
    size = out.stat().st_size
    print(
        f"wrote {out} ({len(data['steps'])} steps, {samples} samples, {size / 1024:.0f} KiB); "
        f"open it in a browser: file://{out.resolve()}"
    )
    return 0
