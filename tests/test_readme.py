"""The README's env example works as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import run_sim

from headrace.engine import registry

pytestmark = pytest.mark.timeout(30)


async def test_readme_env_example_registers_and_runs(tmp_path):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "register_env" in block)
    with registry.envs.scoped("reverse"):  # registered for this test only
        exec(compile(code, "README.md", "exec"), {})
        # the sim never reverses a word: without the filter its constant groups still train
        summary = await run_sim(tmp_path, env="reverse", steps=2, set={"advantages.filter_constant": "false"})
    assert len(summary.metrics) == 2
