"""One static, self-contained HTML page to browse a run's steps and sampled completions.

The data (``metrics.jsonl`` figures and ``rollouts/step_*.jsonl``) is embedded as JSON and drawn
by inline JS with ``textContent`` only: completions are untrusted model output and are never parsed
as HTML. Nothing is fetched: the page works from a file:// URL on a machine without network.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
from pathlib import Path
from typing import Any

from headrace.core.errors import ConfigError
from headrace.core.files import atomic_write

ASSETS = Path(__file__).with_name("assets")
STEP_FIGURES = ("reward/mean", "reward/std", "staleness/mean", "time/step", "groups/trained")
CONFIG_FIGURES = ("env", "model", "backend", "sampler", "scheduler", "steps", "batch_size", "group_size", "seed")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a line that does not parse (a run cut off mid-write) is skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def collect(run_dir: Path) -> dict[str, Any]:
    """What the page shows: the run's config summary and, per step, its figures and samples."""
    metrics_path, rollouts = run_dir / "metrics.jsonl", run_dir / "rollouts"
    if not metrics_path.is_file() and not rollouts.is_dir():
        raise ConfigError(
            f"'{run_dir}' has neither metrics.jsonl nor rollouts/; pass the directory a run wrote (its --run-dir)"
        )
    steps: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(metrics_path) if metrics_path.is_file() else []:
        if isinstance(row.get("step"), int):
            figures = {k: row[k] for k in STEP_FIGURES if isinstance(row.get(k), int | float)}
            steps.setdefault(row["step"], {"samples": []})["figures"] = figures
    for path in sorted(rollouts.glob("step_*.jsonl")) if rollouts.is_dir() else []:
        match = re.fullmatch(r"step_(\d+)\.jsonl", path.name)
        if match:
            steps.setdefault(int(match[1]), {"figures": {}})["samples"] = read_jsonl(path)
    config: dict[str, Any] = {}
    if (run_dir / "config.json").is_file():
        try:
            full = json.loads((run_dir / "config.json").read_text())
            config = {k: full[k] for k in CONFIG_FIGURES if full.get(k) is not None}
        except (json.JSONDecodeError, TypeError):
            pass
    return {
        "run": str(run_dir),
        "config": config,
        "steps": [
            {"step": n, "figures": s.get("figures", {}), "samples": s.get("samples", [])}
            for n, s in sorted(steps.items())
        ],
    }


def _finite(data: Any) -> Any:
    """``data`` with NaN and infinities as None (JSON has no such numbers; the page shows "–")."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(v) for v in data]
    return data


def _embed(data: Any) -> str:
    """JSON that is safe inside a <script> element: no '<', '>' or '&' can end or open a tag."""
    text = json.dumps(_finite(data), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(data: dict[str, Any]) -> str:
    title = f"headrace · {Path(data['run']).name}"
    script = (ASSETS / "view.js").read_text()
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        # A second wall behind the escaping: nothing is loaded from anywhere, and the one script
        # that may run is ours (by hash), so markup in a sample could not run even if it got in.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        f"style-src 'unsafe-inline'; script-src 'sha256-{digest}'\">\n"
        f"<title>{html.escape(title)}</title>\n"
        f"<style>{(ASSETS / 'view.css').read_text()}</style>\n</head><body>\n"
        f'<script id="data" type="application/json">{_embed(data)}</script>\n'
        f"{(ASSETS / 'view.html').read_text()}"
        f"<script>{script}</script>\n</body></html>\n"
    )


def write_page(run_dir: Path, out: Path | None = None) -> tuple[Path, dict[str, Any]]:
    if not run_dir.is_dir():
        raise ConfigError(f"'{run_dir}' is not a directory; pass the directory a run wrote (its --run-dir)")
    data = collect(run_dir)
    out = out or run_dir / "view.html"
    atomic_write(out, render(data))  # a link at ``out`` is replaced, never written through
    return out, data
