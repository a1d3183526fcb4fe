"""``openenv``: an OpenEnv environment server as a headrace env, played through openenv-core's client.

Each episode opens a session of its own on the server (one WebSocket: ``EnvClient``, by default
``GenericEnvClient``, which speaks any server in dicts): ``reset`` gives the first observation, each
reply of the model becomes an action, and ``step`` answers with the next observation, the reward
and whether the episode is over. When it ends, the server's ``state`` is logged (``openenv_state``
in the run's log.jsonl) and its numbers are reported as ``state/<name>``. The G episodes of a
group reset with one seed, so they play the same problem; an episode is multi-turn over messages
(:class:`~headrace.envs.message.MessageEnv`), so it trains as one sequence, token in / token out.

Text in, text out:

- **observation -> message**: the observation's ``observation_field``; else the first of
  ``prompt``, ``text``, ``message``, ``content``, ``observation``, ``output`` that holds text; else
  its only text field; else the whole observation as JSON.
- **reply -> action**: ``action`` (``module:function``, text -> an action, raising ``ValueError``
  for a reply that is none) where the default will not do; by default the server's action schema
  (``GET /schema``) decides: an action of one field (or one required field) gets the reply in it
  (a number field the reply's first number), ``action_field=NAME`` names the field, and an action
  of several fields is the reply read as a JSON object.

A reply that makes no action, or that the server refuses (its validation error), ends the episode
with ``invalid_action_reward`` (``invalid_action`` 1 in the metrics).

Options: ``url`` (the server, ``http://HOST:PORT``; required), ``client`` (``module:Class``, an
``EnvClient`` subclass: then give ``action`` too, making the actions it takes), ``action``,
``action_field``, ``observation_field``, ``system`` (a system prompt), ``max_turns`` (8),
``reset`` (more arguments for ``reset``: ``--set env_options.reset.difficulty=2``),
``invalid_action_reward`` (0.0), ``message_timeout_s`` (60), ``split`` (``train``: seeds outside
the held-out tenth; ``test``: held-out seeds, each of the first ``eval_size`` (200) once).
From Python: :func:`openenv_dataset`.

The server must admit as many sessions at once as the run plays episodes: ``create_app(...,
max_concurrent_envs=N)`` with ``SUPPORTS_CONCURRENT_SESSIONS = True`` on the ``Environment``.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from headrace.core import logs
from headrace.core.errors import EnvError
from headrace.core.types import EnvGroupBuilder, Metrics, RLDataset, StopCondition, Tokens
from headrace.envs.base import ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageEnv, MessageStep, completion_or_chat
from headrace.plugins.registry import load_reference, register_env
from headrace.renderers import Message, Renderer
from headrace.tasks.problem_sets import ListDataset
from headrace.tasks.word_math import split_of

log = logs.get_logger()

TEXT_FIELDS = ("prompt", "text", "message", "content", "observation", "output")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
INSTALL = "the openenv env needs openenv-core: pip install 'headrace[openenv]' (or pip install openenv-core)"


class InvalidAction(EnvError, ValueError):
    """The model's reply makes no action the server takes."""


@dataclass(frozen=True)
class FieldAction:
    """The reply as the one field of an action: as it stands, or its first number."""

    field: str
    kind: str = "string"  # the field's JSON-schema type

    def __call__(self, text: str) -> dict[str, Any]:
        if self.kind == "string":
            return {self.field: text}
        if self.kind in ("integer", "number"):
            number = _NUMBER.search(text)
            if number is None:
                raise InvalidAction(f"the reply holds no number for the action's field '{self.field}'")
            value = float(number.group())
            return {self.field: int(value) if self.kind == "integer" else value}
        return {self.field: _json(text)}


@dataclass(frozen=True)
class JsonAction:
    """The reply as the action itself, a JSON object."""

    def __call__(self, text: str) -> dict[str, Any]:
        value = _json(text)
        if not isinstance(value, dict):
            raise InvalidAction("the reply is no JSON object, and the action has several fields")
        return value


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidAction("the reply is not JSON") from None


def action_from_schema(schema: Mapping[str, Any], field_name: str = "") -> Callable[[str], dict[str, Any]]:
    """The default reply -> action mapping for an action of JSON schema ``schema`` (see the module)."""
    properties = {k: v for k, v in dict(schema.get("properties", {})).items() if k != "metadata"}
    if field_name:
        if field_name not in properties:
            raise ValueError(f"the action has no field '{field_name}' (its fields: {', '.join(properties) or 'none'})")
        return FieldAction(field_name, _kind(properties[field_name]))
    required = [name for name in schema.get("required", ()) if name in properties]
    if len(properties) == 1 or len(required) == 1:
        name = next(iter(properties)) if len(properties) == 1 else required[0]
        return FieldAction(name, _kind(properties[name]))
    return JsonAction()


def _kind(prop: Mapping[str, Any]) -> str:
    """A field's JSON type; an optional one's (``anyOf: [{type: T}, {type: null}]``) is T."""
    types = [prop.get("type")] + [p.get("type") for p in prop.get("anyOf", ())]
    return next((t for t in types if isinstance(t, str) and t != "null"), "object")


@dataclass(frozen=True)
class ObservationText:
    """An observation as the text of a message (see the module for the default's order)."""

    field: str = ""

    def __call__(self, observation: Any) -> str:
        data = observation_dict(observation)
        if self.field:
            if self.field not in data:
                raise KeyError(f"the observation has no field '{self.field}' (its fields: {', '.join(data)})")
            value = data[self.field]
            return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        for name in TEXT_FIELDS:
            if isinstance(data.get(name), str):
                return data[name]
        texts = [v for v in data.values() if isinstance(v, str)]
        return texts[0] if len(texts) == 1 else json.dumps(data, sort_keys=True, default=str)


def observation_dict(observation: Any) -> dict[str, Any]:
    """A typed client's observation (a pydantic model) as the generic client's dict."""
    if isinstance(observation, Mapping):
        return dict(observation)
    if hasattr(observation, "model_dump"):
        return dict(observation.model_dump(exclude={"reward", "done", "metadata"}))
    return dict(vars(observation))


@dataclass(frozen=True)
class OpenEnvSpec:
    """How to play one OpenEnv server. ``client(url)`` makes an unconnected ``EnvClient``."""

    url: str
    client: Callable[[str], Any]
    to_action: Callable[[str], Any]
    to_text: Callable[[Any], str]
    system: str = ""
    max_turns: int = 8
    reset: Mapping[str, Any] = field(default_factory=dict)
    invalid_action_reward: float = 0.0


class OpenEnvEnv(MessageEnv):
    """One episode: one session on the server, reset with ``seed``."""

    def __init__(self, spec: OpenEnvSpec, seed: int, renderer: Renderer, max_tokens: int):
        super().__init__(renderer, max_tokens, max_turns=spec.max_turns)
        self.spec, self.seed = spec, seed
        self.client: Any = None
        self.first = ""

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        await self.close()  # asked again: start over, on a session of its own
        self.client = self.spec.client(self.spec.url)
        result = await self._call(self.client.reset(seed=self.seed, **self.spec.reset))
        self.first = self.spec.to_text(result.observation)
        return await super().initial_observation()

    def initial_messages(self) -> Sequence[Message]:
        system: list[Message] = [{"role": "system", "content": self.spec.system}] if self.spec.system else []
        return [*system, {"role": "user", "content": self.first}]

    async def respond(self, text: str, clean: bool) -> MessageStep:
        try:
            action = self.spec.to_action(text)
        except ValueError as e:  # InvalidAction, or a user's function refusing the reply
            return await self._end(self.spec.invalid_action_reward, why=str(e) or type(e).__name__)
        try:
            result = await self._call(self.client.step(action))
        except InvalidAction as e:  # the server refused it
            return await self._end(self.spec.invalid_action_reward, why=str(e))
        reward = float(result.reward or 0.0)
        if result.done or self.last_turn:
            return await self._end(reward)
        return MessageStep(reward, messages=[self.spec.to_text(result.observation)])

    async def _end(self, reward: float, why: str = "") -> MessageStep:
        """The episode's last step; ``why``: the reply made no action (it is said why)."""
        state = await self._state()
        log.info("openenv_state", url=self.spec.url, seed=self.seed, reward=reward, invalid=why or None, state=state)
        await self.close()
        numbers = {f"state/{k}": float(v) for k, v in state.items() if isinstance(v, int | float) and k != "episode_id"}
        metrics: Metrics = {"invalid_action": float(bool(why)), **numbers}
        return MessageStep(reward, done=True, metrics=metrics)

    async def _state(self) -> dict[str, Any]:
        try:
            state = await self.client.state()
        except Exception as e:  # noqa: BLE001 - the state is reported, never needed
            log.warning("openenv_state_failed", url=self.spec.url, error=f"{type(e).__name__}: {e}")
            return {}
        return observation_dict(state) if not isinstance(state, Mapping) else dict(state)

    async def _call(self, call: Any) -> Any:
        """A client call; the server's refusals come back as this module's errors."""
        try:
            return await call
        except RuntimeError as e:
            message = str(e)
            if "VALIDATION_ERROR" in message:
                raise InvalidAction(f"the server refused the action ({message})") from None
            if "CAPACITY_REACHED" in message:
                raise RuntimeError(
                    f"the OpenEnv server at {self.spec.url} has no session free ({message}): it admits fewer "
                    "sessions at once than the run plays episodes. Start it with create_app(..., "
                    "max_concurrent_envs=N) (its Environment with SUPPORTS_CONCURRENT_SESSIONS = True), "
                    "N at least group_size x the groups in flight, or run fewer at once (rollout_workers)"
                ) from e
            raise

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        try:
            await client.close()
        except Exception as e:  # noqa: BLE001 - a session already gone is closed
            log.warning("openenv_close_failed", url=self.spec.url, error=f"{type(e).__name__}: {e}")


@dataclass(frozen=True)
class OpenEnvGroup(EnvGroupBuilder):
    """G sessions of one seed; ``cleanup`` closes any an episode left open (a failure, a cancel)."""

    spec: OpenEnvSpec
    seed: int
    group_size: int
    renderer: Renderer
    max_tokens: int
    made: list[OpenEnvEnv] = field(default_factory=list, init=False, repr=False, compare=False)

    async def make_envs(self) -> Sequence[OpenEnvEnv]:
        envs = [OpenEnvEnv(self.spec, self.seed, self.renderer, self.max_tokens) for _ in range(self.group_size)]
        self.made.extend(envs)
        return envs

    async def cleanup(self) -> None:
        for env in self.made:
            await env.close()
        self.made.clear()

    def logging_tags(self) -> list[str]:
        return ["openenv"]

    def __getstate__(self) -> dict[str, Any]:  # shipped to another process: without live sessions
        return {**self.__dict__, "made": []}


def fetch_schema(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The server's schemas (``GET /schema``): what its actions, observations and state look like."""
    address = re.sub(r"^ws", "http", url.rstrip("/")) + "/schema"
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as response:  # noqa: S310 - the user's server
            return dict(json.loads(response.read()))
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ValueError(
            f"cannot read the OpenEnv server's action schema at {address} ({e}); start the server "
            "(e.g. uvicorn my_env.server.app:app --port 8000) or fix env_options.url"
        ) from None


def generic_client(message_timeout_s: float = 60.0) -> Callable[[str], Any]:
    """``GenericEnvClient``: any server, actions and observations as dicts."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError:
        raise ValueError(INSTALL) from None
    return functools.partial(GenericEnvClient, message_timeout_s=message_timeout_s)


def openenv_dataset(
    ctx: EnvContext,
    url: str,
    *,
    client: Callable[[str], Any] | None = None,
    to_action: Callable[[str], Any] | None = None,
    to_text: Callable[[Any], str] | None = None,
    system: str = "",
    max_turns: int = 8,
    reset: Mapping[str, Any] | None = None,
    invalid_action_reward: float = 0.0,
    split: str = "train",
    eval_size: int = 200,
) -> RLDataset:
    """The OpenEnv server at ``url`` as a dataset of episodes, G a seed. ``client(url)`` makes
    the ``EnvClient`` (default: ``GenericEnvClient``), ``to_action(text)`` an action from a reply
    (default: from the server's action schema), ``to_text(observation)`` a message's text. For
    ``--cluster ray`` the functions must be picklable (module-level, not lambdas)."""
    if max_turns < 1 or eval_size < 1:
        raise ValueError(f"the openenv env needs max_turns >= 1 and eval_size >= 1 (got {max_turns}, {eval_size})")
    spec = OpenEnvSpec(
        url=url,
        client=client or generic_client(),
        to_action=to_action or action_from_schema(fetch_schema(url).get("action", {})),
        to_text=to_text or ObservationText(),
        system=system,
        max_turns=max_turns,
        reset=dict(reset or {}),
        invalid_action_reward=invalid_action_reward,
    )
    renderer = completion_or_chat(ctx)

    def group(seed: int) -> OpenEnvGroup:
        return OpenEnvGroup(spec, seed, ctx.group_size, renderer, ctx.max_tokens)

    if split == "test":
        return ListDataset(held_out_seeds(eval_size), group, ctx.batch_size)
    return ProblemDataset.from_context(ctx, lambda rng: group(training_seed(rng)))


def training_seed(rng: random.Random) -> int:
    """A reset seed outside the held-out tenth."""
    while True:
        seed = rng.randrange(2**31)
        if split_of(f"openenv/{seed}") == "train":
            return seed


def held_out_seeds(count: int) -> list[int]:
    """The first ``count`` seeds of the held-out tenth."""
    return list(itertools.islice((s for s in itertools.count() if split_of(f"openenv/{s}") == "test"), count))


DEFAULTS: dict[str, Any] = {
    "url": "",
    "client": "",
    "action": "",
    "action_field": "",
    "observation_field": "",
    "system": "",
    "max_turns": 8,
    "reset": {},
    "invalid_action_reward": 0.0,
    "message_timeout_s": 60.0,
    "split": "train",
    "eval_size": 200,
}


@register_env("openenv", options=DEFAULTS)
def make_dataset(ctx: EnvContext) -> RLDataset:
    """An OpenEnv server (env_options.url), played through openenv-core's client."""
    options = ctx.options
    url = options["url"]
    if not url:
        raise ValueError(
            "the openenv env needs its server's address: --set env_options.url=http://HOST:PORT "
            "(an OpenEnv server started with uvicorn, or a Hugging Face Space's URL)"
        )
    client = (
        load_reference(options["client"], "OpenEnv client")
        if options["client"]
        else generic_client(options["message_timeout_s"])
    )
    if options["action"]:
        to_action = load_reference(options["action"], "OpenEnv action function")
    elif options["client"]:
        raise ValueError(
            f"the openenv env's client {options['client']} takes its own action type: name the function that "
            "makes one from the model's reply, --set env_options.action=module:function"
        )
    else:
        to_action = action_from_schema(fetch_schema(url).get("action", {}), options["action_field"])
    return openenv_dataset(
        ctx,
        url,
        client=client,
        to_action=to_action,
        to_text=ObservationText(options["observation_field"]),
        system=options["system"],
        max_turns=options["max_turns"],
        reset=options["reset"],
        invalid_action_reward=options["invalid_action_reward"],
        split=options["split"],
        eval_size=options["eval_size"],
    )
