"""Reading Harbor task directories (the format of harbor-framework/harbor, read from its 0.26
source: ``models/task/paths.py``, ``models/task/config.py``, ``verifier/verifier.py``):

    my-task/
      instruction.md        the prompt
      task.toml             [verifier] timeout_sec, env; [agent] timeout_sec;
                            [environment] workdir, memory_mb, env, docker_image; [metadata]
      environment/          optional: Dockerfile (the image) and its build context
      tests/test.sh         the verifier: run from the workdir after the agent, it writes
                            /logs/verifier/reward.json ({"reward": 1.0, ...}) or reward.txt
      solution/solve.sh     optional: the oracle's answer (Harbor's OracleAgent)

headrace has no container runtime, so the image is not built: the host's tools stand in for it
(``rootfs``). From the Dockerfile, ``WORKDIR``, ``ENV``, ``COPY``/``ADD`` of files in the build
context and ``RUN`` (run at episode setup, network off, so an ``apt-get``/``pip install``
fails there, and says so) are honoured; ``FROM``, ``USER``, ``ARG``, ``EXPOSE``, ``CMD``,
``ENTRYPOINT``, ``LABEL`` are ignored. Not supported: ``docker-compose.yaml`` environments,
multi-step tasks (``[[steps]]``), Windows tasks (``test.bat``), network access (every phase
runs with the network off, whatever ``network_mode`` says), GPUs, MCP servers, the separate
verifier environment, and ``COPY --from`` or URLs.

headrace's own keys (harbor ignores unknown keys): a task's split is its top-level ``split``
(OpenReward's convention) or ``[metadata] split``, ``train`` or ``test``. The test split is the
tasks marked ``test`` (every task when none is: a benchmark evaluates on what it trains on),
the train split the others. ``[metadata] answer_file = "/app/x"``: the model's reply is that
file's content, instead of a shell script.
"""

from __future__ import annotations

import os
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headrace.core.errors import EnvError

IGNORED = {"FROM", "USER", "ARG", "EXPOSE", "CMD", "ENTRYPOINT", "LABEL", "HEALTHCHECK", "SHELL", "VOLUME"}
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


class HarborTaskError(EnvError, ValueError):
    pass


@dataclass(frozen=True)
class HarborTask:
    name: str
    path: Path
    instruction: str
    workdir: str = "/app"
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 600.0
    memory_mb: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # the image's ENV and [environment].env
    verifier_env: dict[str, str] = field(default_factory=dict)
    copies: tuple[tuple[str, str], ...] = ()  # (path in environment/, absolute path inside)
    setup: tuple[str, ...] = ()  # the Dockerfile's RUN commands, in order
    split: str | None = None
    answer_file: str | None = None

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution(self) -> Path | None:
        solve = self.path / "solution" / "solve.sh"
        return solve if solve.is_file() else None


def resolve_vars(values: dict[str, Any]) -> dict[str, str]:
    """``${VAR}`` and ``${VAR:-default}`` from the engine's environment, as Harbor does."""

    def one(m: re.Match) -> str:
        if m.group(1) in os.environ:
            return os.environ[m.group(1)]
        if m.group(2) is not None:
            return m.group(2)
        raise HarborTaskError(f"${{{m.group(1)}}} is not set in the environment")

    return {str(k): _VAR.sub(one, str(v)) for k, v in values.items()}


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\r?\n", " ", dockerfile.read_text(encoding="utf-8"))  # line continuations
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _exec_form(rest: str) -> list[str]:
    if rest.startswith("["):
        import json

        return [str(x) for x in json.loads(rest)]
    return shlex.split(rest)


def read_dockerfile(task: Path, workdir: str | None) -> tuple[str, dict[str, str], list[tuple[str, str]], list[str]]:
    """(workdir, env, copies, setup) from ``environment/Dockerfile``; a missing file gives the defaults."""
    dockerfile = task / "environment" / "Dockerfile"
    cwd, env, copies, setup = "/", dict[str, str](), list[tuple[str, str]](), list[str]()
    if not dockerfile.is_file():
        return workdir or "/app", env, copies, setup
    for keyword, rest in _instructions(dockerfile):
        if keyword == "WORKDIR":
            cwd = os.path.normpath(os.path.join(cwd, rest))
        elif keyword == "ENV":
            parts = shlex.split(rest)
            pairs = [p.split("=", 1) for p in parts] if "=" in parts[0] else [[parts[0], " ".join(parts[1:])]]
            env.update({k: v for k, v in pairs})
        elif keyword in ("COPY", "ADD"):
            raw = _exec_form(rest)
            args = [a for a in raw if not a.startswith("--")]
            if any(a.startswith("--from") for a in raw) or any("://" in a for a in args):
                raise HarborTaskError(f"{dockerfile}: `{keyword} {rest}` copies from another image or a URL")
            *sources, dest = args
            dest = os.path.normpath(os.path.join(cwd, dest)) + ("/" if dest.endswith("/") or len(sources) > 1 else "")
            copies += [(src, dest) for src in sources]
        elif keyword == "RUN":
            setup.append(" ".join(shlex.quote(a) for a in _exec_form(rest)) if rest.startswith("[") else rest)
        elif keyword not in IGNORED:
            raise HarborTaskError(f"{dockerfile}: the instruction {keyword} is not supported without a container")
    return workdir or (cwd if cwd != "/" else "/app"), env, copies, setup


def load_task(path: str | Path) -> HarborTask:
    """One task directory, checked: a clear ``HarborTaskError`` for what headrace cannot run."""
    path = Path(path).expanduser().resolve()
    for needed in ("task.toml", "instruction.md", "tests/test.sh"):
        if not (path / needed).is_file():
            raise HarborTaskError(f"{path} is not a Harbor task: it has no {needed}")
    try:
        config = tomllib.loads((path / "task.toml").read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise HarborTaskError(f"{path / 'task.toml'} is not valid TOML: {e}") from None
    if config.get("steps"):
        raise HarborTaskError(f"{path} is a multi-step task ([[steps]]), which headrace does not run")
    environment = config.get("environment", {})
    if environment.get("os", "linux").lower() != "linux":
        raise HarborTaskError(f"{path} targets {environment['os']}; headrace runs Linux tasks only")
    if any((path / "environment" / f).exists() for f in ("docker-compose.yaml", "docker-compose.yml")):
        raise HarborTaskError(f"{path} has a docker-compose environment, which needs a container runtime")
    metadata = config.get("metadata", {})
    workdir, env, copies, setup = read_dockerfile(path, environment.get("workdir"))
    split = config.get("split", metadata.get("split"))
    if split not in (None, "train", "test"):
        raise HarborTaskError(f"{path}: split must be 'train' or 'test' (got {split!r})")
    return HarborTask(
        name=config.get("task", {}).get("name") or path.name,
        path=path,
        instruction=(path / "instruction.md").read_text(encoding="utf-8").strip(),
        workdir=workdir,
        agent_timeout_s=float(config.get("agent", {}).get("timeout_sec") or 600.0),
        verifier_timeout_s=float(config.get("verifier", {}).get("timeout_sec", 600.0)),
        memory_mb=environment.get("memory_mb"),
        env=env | resolve_vars(environment.get("env", {})),
        verifier_env=resolve_vars(config.get("verifier", {}).get("env", {})),
        copies=tuple(copies),
        setup=tuple(setup),
        split=split,
        answer_file=metadata.get("answer_file"),
    )


def find_tasks(root: str | Path) -> list[HarborTask]:
    """The task at ``root``, or every task below it (directories holding a task.toml), by path."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise HarborTaskError(f"{root} is not a directory (env_options.path names a task or a folder of tasks)")
    if (root / "task.toml").is_file():
        return [load_task(root)]
    tasks = [load_task(p.parent) for p in sorted(root.rglob("task.toml"))]
    if not tasks:
        raise HarborTaskError(f"{root} holds no Harbor task (no task.toml below it)")
    return tasks
