"""``verifiers``: a verifiers environment (``verifiers.v1``) as a headrace env. Its own rollouts run,
their model calls answered by the run's sampler, and the run trains on its rewards.

A verifiers environment is a taskset package: the id ``vf-eval`` takes (``reverse-text``; a hub
id ``owner/name@version`` is installed as ``name``), loaded the way verifiers loads one
(``vf.resolve_env_config`` then ``vf.load_environment``). Its tasks are the problems, G episodes
of a task a group, and each episode is the environment's own ``Env.run_episode``: its harness
(the program that plays the agent: by default verifiers' chat loop, the task's tools served to it
as MCP servers), its ``@vf.stop`` and ``@vf.intercept`` hooks, its ``@vf.reward`` and
``@vf.metric`` rubric. The model calls go through verifiers' interception server to the episode's
``base_url`` on the agents' endpoint (``headrace/agents``: an agent is an env), which answers each
with the run's sampler and captures it token in / token out. The episode's reward is the trace's
(the weighted sum of its rewards; the mean over an episode's trainable traces); its figures are
``verifiers/reward/<name>``, ``verifiers/<metric>``, ``verifiers/turns``, ``verifiers/truncated``
beside the endpoint's ``agent/...``. An episode verifiers reports as failed (its harness crashed,
a tool server died) raises, so it is retried against the group's budget.

Options: ``id`` (required), ``taskset`` (the taskset's config, verifiers' ``--env.taskset.*``:
``--set env_options.taskset.difficulty=2``), ``config`` (the rest of its ``EnvConfig``,
``--env.*``: ``agent.max_turns``, ``timeout``...), ``env_id`` (an ``Env`` to pair with the
taskset, verifiers' ``--env.id``), ``harness`` (every seat's harness id; default the
environment's own), ``runtime`` (where a harness runs: ``subprocess``, the default here; verifiers'
own default is Prime's sandboxes), ``chat_program`` (``auto``: how verifiers' chat harnesses,
``bash`` and ``null``, run their program: ``uv``, as verifiers does, in a uv script environment it
downloads; ``python``, with this Python, whose packages verifiers already installed; ``auto``:
``python`` when ``uv`` is not on the PATH), ``max_tasks`` (0: all; needed for an infinite taskset),
``split`` and ``eval_taskset``.

The held-out split (``split=test``, what the run's evaluation asks for): the taskset's config
updated with ``eval_taskset`` when given; else a taskset whose config has a ``split`` field gets
``split=test`` (and ``train`` for training); else a tenth of the tasks, by a hash of their data,
is held out.

Every seat calls the run's model unless its config names a client of its own: a seat verifiers
marks untrainable (a judge) without one trains with the episode, as headrace's endpoint cannot
tell its calls apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import random
import shutil
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from headrace.agents import AgentDataset, AgentEpisode, AgentResult, agent_env
from headrace.core.errors import EnvError
from headrace.core.types import EnvGroupBuilder, Metrics, RLDataset
from headrace.envs.context import EnvContext
from headrace.plugins.registry import register_env
from headrace.tasks.word_math import split_of

INSTALL = "the verifiers env needs verifiers: pip install 'headrace[verifiers]' (or pip install verifiers)"
UNUSED_KEY_VAR = "HEADRACE_VERIFIERS_UNUSED_KEY"  # the client's key comes from the episode, never from here


class VerifiersEpisodeError(EnvError, RuntimeError):
    """verifiers reported the episode failed (its errors, last first)."""


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ValueError(INSTALL) from None
    return vf


class VerifiersEnvironment:
    """A loaded verifiers environment and whether the run serves it (``Env.serving``: its
    interception server, its shared tool servers)."""

    def __init__(self, env: Any):
        self.env = env
        self.serving = False
        self._alone: asyncio.Lock | None = None  # outside a run: one episode served at a time

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        async with self.env.serving():
            self.serving = True
            try:
                yield
            finally:
                self.serving = False

    @contextlib.asynccontextmanager
    async def served(self) -> AsyncIterator[Any]:
        """The interception server: the run's, or outside a run one for this episode alone (the
        environment holds one serving at a time, so such episodes take turns)."""
        async with contextlib.AsyncExitStack() as stack:
            if not self.serving:
                self._alone = self._alone or asyncio.Lock()
                await stack.enter_async_context(self._alone)
                await stack.enter_async_context(self.env.serving())
            server = getattr(self.env, "_interception", None)
            if server is None or not hasattr(server, "clients"):
                raise RuntimeError(
                    f"the verifiers environment serves no interception server headrace knows ({server!r}); "
                    "headrace's adapter is written for verifiers 0.4 (interception type 'server')"
                )
            yield server


class VerifiersAgent:
    """The agent of every episode: the environment's own ``run_episode`` on the episode's task,
    its model client on the episode's endpoint."""

    def __init__(self, environment: VerifiersEnvironment):
        self.environment = environment

    async def __call__(self, episode: AgentEpisode) -> AgentResult:
        vf = _vf()
        config = vf.EvalClientConfig(base_url=episode.base_url, api_key_var=UNUSED_KEY_VAR)
        ctx = vf.ModelContext(model=episode.model, client=config)
        async with self.environment.served() as server, episode_client(server, config, episode):
            result = await self.environment.env.run_episode(episode.problem, ctx)
        return outcome(result)


@contextlib.asynccontextmanager
async def episode_client(server: Any, config: Any, episode: AgentEpisode) -> AsyncIterator[None]:
    """The episode's model client, put where verifiers' interception server looks for it and
    taken out after: the server keeps one client per endpoint for its life, and each episode has
    an endpoint of its own, so a client left there would be one more kept per episode."""
    key = config.model_dump_json()
    client = server.clients[key] = episode_client_class()(episode, config)
    try:
        yield
    finally:
        server.clients.pop(key, None)
        await client.close()  # the run's shared pool stays open (its aclose does nothing)


@functools.cache
def episode_client_class() -> type:
    """verifiers' relay client (``EvalClient``) on an episode's endpoint: its key the episode's
    (not read from an environment variable), its connections the run's pool."""
    from verifiers.v1.clients.base import build_async_httpx
    from verifiers.v1.clients.eval import EvalClient

    class EpisodeClient(EvalClient):
        def __init__(self, episode: AgentEpisode, config: Any) -> None:
            self.base_url, self.api_key = episode.base_url, episode.api_key
            self.headers: dict[str, str] = {}
            self.client = episode.http_client if episode.http_client is not None else build_async_httpx(config)

    return EpisodeClient


def outcome(result: Any) -> AgentResult:
    """An episode's reward and figures; an episode verifiers reports failed raises."""
    if not result.ok:
        errors = [*result.errors, *(e for trace in result.traces for e in trace.errors)]
        said = "; ".join(f"{e.type}: {e.message}"[:300] for e in reversed(errors)) or "no error recorded"
        raise VerifiersEpisodeError(f"the verifiers episode failed: {said}")
    traces = [t for t in result.traces if t.agent.trainable] or list(result.traces)
    figures: dict[str, list[float]] = {
        "verifiers/turns": [t.num_turns for t in traces],
        "verifiers/truncated": [float(t.is_truncated) for t in traces],
    }
    for trace in traces:  # one trace (a single-agent env) in all but multi-agent envs: their mean
        for name, reward in trace.rewards.items():
            if reward is not None:
                figures.setdefault(f"verifiers/reward/{name}", []).append(reward.score)
        for name, value in trace.metrics.items():
            if value is not None:
                figures.setdefault(f"verifiers/{name}", []).append(float(value))
    metrics: Metrics = {name: _mean(values) for name, values in figures.items()}
    return AgentResult(_mean([t.reward for t in traces]), metrics=metrics)


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


class VerifiersDataset(RLDataset):
    """The agents' dataset of the environment's episodes; its lifespan serves both the endpoint
    and the environment."""

    def __init__(self, episodes: AgentDataset, environment: VerifiersEnvironment):
        self.episodes, self.environment = episodes, environment

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return self.episodes.get_batch(index)

    def __len__(self) -> int:
        return len(self.episodes)

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        async with self.episodes.lifespan(), self.environment.lifespan():
            yield


def environment_config(
    env_id: str,
    *,
    taskset: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    pair: str = "",
    harness: str = "",
    runtime: str = "subprocess",
) -> Any:
    """verifiers' ``EnvConfig`` for ``env_id``, every seat on ``runtime`` (unless ``config`` names
    its own) and ``harness`` (when given), the interception one server on loopback."""
    vf = _vf()
    raw: dict[str, Any] = json.loads(json.dumps(config or {}))  # a deep copy: the caller's stays as given
    raw["taskset"] = {**raw.get("taskset", {}), **(taskset or {}), "id": env_id}
    if pair:
        raw["id"] = pair
    interception = raw.setdefault("interception", {"type": "server"})
    if interception.get("type", "server") != "server":
        raise ValueError(
            f"the verifiers env runs its interception as one server (got interception.type={interception['type']!r}); "
            "leave env_options.config.interception.type unset"
        )
    interception["type"] = "server"
    config_type = installed(env_id, lambda name: vf.env_config_type(name, pair))
    for seat, declared in config_type.model_fields.items():
        if isinstance(declared.default, vf.AgentConfig):
            spec = raw.setdefault(seat, {})
            spec.setdefault("runtime", {"type": runtime})
            if harness:
                spec["harness"] = {**spec.get("harness", {}), "id": harness}
    return vf.resolve_env_config(raw)


def installed(env_id: str, look_up: Any) -> Any:
    """``look_up(env_id)``, a verifiers loader; an environment not installed is said in one paragraph."""
    try:
        return look_up(env_id)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"the verifiers environment '{env_id}' is not installed ({e}). Install its package (pip install it, "
            "or `prime env install OWNER/NAME` for one from the Environments Hub) or put it on PYTHONPATH"
        ) from None


def use_this_python_for_the_chat_program() -> None:
    """verifiers' chat harnesses (``bash``, ``null``) run one program, a uv script; a subprocess
    runtime prepares it once per process and keeps which interpreter runs it. Say that this
    Python does (verifiers brought its packages: openai, mcp, httpx...), so no uv environment is
    made for it: the same program, run by this interpreter."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.is_file() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{random.getrandbits(32):08x}.tmp")
        partial.write_bytes(data)
        partial.replace(path)
    SubprocessRuntime._interpreters.setdefault(str(path), sys.executable)


def task_split(task: Any) -> str:
    """``test`` for the held-out tenth of tasks, by a hash of their data (not their position)."""
    data = task.data
    identity = data.id or json.dumps(data.model_dump(mode="json", exclude={"idx"}), sort_keys=True, default=str)
    return split_of(f"verifiers/{identity}")


def verifiers_dataset(
    ctx: EnvContext,
    env_id: str,
    *,
    taskset: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    pair: str = "",
    harness: str = "",
    runtime: str = "subprocess",
    chat_program: str = "auto",
    split: str = "train",
    eval_taskset: dict[str, Any] | None = None,
    max_tasks: int = 0,
) -> RLDataset:
    """The verifiers environment ``env_id`` as a dataset of its episodes (see the module)."""
    if chat_program not in ("auto", "uv", "python"):
        raise ValueError(f"the verifiers env's chat_program is auto, uv or python (got {chat_program!r})")
    if chat_program == "python" or (chat_program == "auto" and shutil.which("uv") is None):
        use_this_python_for_the_chat_program()
    vf = _vf()
    overrides = dict(taskset or {})
    own_split = "split" in installed(env_id, vf.taskset_config_type).model_fields and "split" not in overrides
    if own_split:
        overrides["split"] = split
    if split == "test" and eval_taskset:
        overrides |= eval_taskset
    env_config = environment_config(
        env_id, taskset=overrides, config=config, pair=pair, harness=harness, runtime=runtime
    )
    environment = VerifiersEnvironment(vf.load_environment(env_config))
    tasks = environment.env.taskset
    if max_tasks:
        tasks = tasks.take(max_tasks)
    elif not tasks.bounded:
        raise ValueError(f"the verifiers environment '{env_id}' is infinite: bound it with env_options.max_tasks=N")
    problems = list(tasks)
    if not (own_split or eval_taskset):  # no split of its own: hold out a tenth
        problems = [task for task in problems if task_split(task) == split]
    if not problems:
        raise ValueError(f"the verifiers environment '{env_id}' has no tasks in its {split} split")
    if split == "train":
        random.Random(f"verifiers/{ctx.seed}").shuffle(problems)
    tags = ("verifiers", env_id)
    return VerifiersDataset(agent_env(ctx, VerifiersAgent(environment), problems, tags=tags), environment)


DEFAULTS: dict[str, Any] = {
    "id": "",
    "taskset": {},
    "config": {},
    "env_id": "",
    "harness": "",
    "runtime": "subprocess",
    "chat_program": "auto",
    "split": "train",
    "eval_taskset": {},
    "max_tasks": 0,
}


@register_env("verifiers", options=DEFAULTS)
def make_dataset(ctx: EnvContext) -> RLDataset:
    """A verifiers environment (env_options.id), its own rollouts through the agents' endpoint."""
    options = ctx.options
    if not options["id"]:
        raise ValueError(
            "the verifiers env needs the environment's id: --set env_options.id=ENV_ID "
            "(an installed verifiers environment, the id vf-eval takes)"
        )
    return verifiers_dataset(
        ctx,
        options["id"],
        taskset=options["taskset"],
        config=options["config"],
        pair=options["env_id"],
        harness=options["harness"],
        runtime=options["runtime"],
        chat_program=options["chat_program"],
        split=options["split"],
        eval_taskset=options["eval_taskset"],
        max_tasks=options["max_tasks"],
    )
