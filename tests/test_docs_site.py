"""The docs site builds: `mkdocs build --strict` (what `make docs` and .ci/run run) passes, so a
broken link or anchor, a page missing from the nav or a link to a repository file that does not
exist fails the suite as well as CI (issue 23, item 11)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav names (one `- Title: page.md` a line)."""
    lines = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1].splitlines()
    return [line.rsplit(":", 1)[1].strip() for line in lines if line.strip().startswith("- ")]


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists():
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav_pages()) == pages, "add the page to mkdocs.yml's nav (or remove the entry)"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mkdocs_build_strict_passes(tmp_path):
    pytest.importorskip("mkdocs", reason="`bash scripts/setup.sh .venv docs` installs mkdocs-material (make test does)")
    pytest.importorskip("material", reason="`bash scripts/setup.sh .venv docs` installs mkdocs-material")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    assert (site / "configuration" / "index.html").is_file() and (
        site / "repo" / "ARCHITECTURE" / "index.html"
    ).is_file()
    # a link to a repository file leads into the site, to the file itself
    quickstart = (site / "quickstart" / "index.html").read_text()
    assert (
        'href="../repo/benchmarks/RESULTS/"' in quickstart
        and (site / "repo" / "benchmarks" / "default_run.png").is_file()
    )
