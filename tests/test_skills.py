"""The skills in skills/ (SKILL.md files for AI coding assistants, issue 23 item 12) are well
formed and their examples run as written: each Python block that opens with `# FILE.py` is saved
under that name, then each bash block runs in that directory, in order, with the runner of the
docs' commands (tests/test_readme.py). Every example uses the sim backend or no model, so the
whole file is fast."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_readme import _run_block, _steps_as_asked, doc_commands, fences

ROOT = Path(__file__).parent.parent
SKILLS = sorted((ROOT / "skills").glob("*/SKILL.md"))
NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

pytestmark = pytest.mark.timeout(300)


def front_matter(skill: Path) -> dict[str, str]:
    text = skill.read_text()
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, f"{skill}: no front matter (---, name: ..., description: ..., ---) at the top"
    fields = {}
    for line in match[1].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def test_there_are_the_four_skills_the_readme_names():
    names = {skill.parent.name for skill in SKILLS}
    assert names == {"writing-envs", "choosing-a-scheduler-and-loss", "debugging-a-run", "writing-a-backend-plugin"}
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in names)


@pytest.mark.parametrize("skill", SKILLS, ids=lambda p: p.parent.name)
def test_each_skill_has_the_front_matter_assistants_read(skill):
    fields = front_matter(skill)
    assert set(fields) == {"name", "description"}, fields
    assert fields["name"] == skill.parent.name and NAME.match(fields["name"]) and len(fields["name"]) <= 64
    assert 40 <= len(fields["description"]) <= 1024, fields["description"]
    assert "Use when" in fields["description"], "say when an assistant should use it"


def skill_files(skill: Path) -> dict[str, str]:
    """The files a skill's Python blocks define (their first line: `# FILE.py`)."""
    files = {}
    for where, code in fences(("python",), [skill]):
        first = code.splitlines()[0]
        assert re.match(r"^# [\w./-]+\.py$", first), f"{where}: a Python block opens with `# FILE.py` (its file name)"
        files[first[2:]] = code
    return files


@pytest.mark.parametrize("skill", SKILLS, ids=lambda p: p.parent.name)
def test_each_skills_examples_run_as_written(skill, tmp_path):
    for name, code in skill_files(skill).items():
        compile(code, f"{skill.parent.name}/{name}", "exec")
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(code)
    blocks = [commands for _, commands in doc_commands([skill])]
    assert blocks, f"{skill}: no command runs its examples"

    def check(command: str, out: str) -> None:
        _steps_as_asked(tmp_path, command)

    for commands in blocks:
        _run_block(commands, tmp_path, timeout=240, check=check)
