"""One agent episode's side of the endpoint: each call the agent makes becomes a turn of the episode.

A call is rendered by the run's renderer (its tools too), sampled through the episode's
``policy`` (the run's sampler, the episode's checks, recorded as a transition) and answered in
OpenAI's shape. The sampling runs as a task of the episode's own task group (``open``), never of
the HTTP connection that asked: when the episode ends, is cancelled or times out, its pending
calls are cancelled with it and their callers told so (410).

Token in, token out: when a call's history is the history of an earlier call of the episode plus
the assistant message that call returned, its prompt is that call's prompt, the tokens sampled
(exactly as sampled), then the new messages (``Renderer.continuation_with_tools``): nothing sampled
is re-tokenised and the turn continues the same training sequence. Any other history (an agent
that edits, trims or summarises it) is rendered whole, and starts a new sequence of the episode
where it does not extend the last one (``core/datums.py``); ``metrics()`` counts both.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from headrace.core.episode import EpisodeOver, Policy
from headrace.core.errors import EnvError
from headrace.core.types import SampledTokens, StopCondition, StopReason, Tokens
from headrace.net.openai_completions import CompletionRequest, text_completion_body
from headrace.net.openai_responses import ResponsesRequest, response_body
from headrace.net.openai_wire import (
    Answer,
    ApiError,
    ChatRequest,
    answer,
    completion_body,
    token_logprobs,
)
from headrace.renderers import Renderer
from headrace.renderers.tools import Reply, Tool, arguments_of

Key = tuple[Any, ...]


def message_key(m: dict[str, Any]) -> Key:
    """What of a message the prompt depends on: role, text, and each call's name and arguments
    (ids and the fields an OpenAI client adds, such as ``refusal``, left out)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(arguments_of(c), sort_keys=True)) for c in m.get("tool_calls") or ()
    )
    return (m["role"], m.get("content") or "", calls)


@dataclass(frozen=True)
class _Served:
    """A call answered: what a later call's history is compared with."""

    history: list[Key]
    tools: str
    prompt: Tokens
    action: SampledTokens
    reply: Key


@dataclass(frozen=True)
class Turn:
    """A call's outcome: the answer as the client sees it, its calls, the prompt's length, the version."""

    answer: Answer
    reply: Reply
    prompt_tokens: int
    version: int


class EpisodeEnded(EnvError):
    """The episode took no more calls (its agent returned, it timed out or was cancelled)."""


class EpisodeBridge:
    def __init__(self, episode_id: str, renderer: Renderer, tokenizer: Any, max_tokens: int, model: str):
        self.id, self.renderer, self.tokenizer = episode_id, renderer, tokenizer
        self.max_tokens, self.model = max_tokens, model
        self.calls: list[tuple[Tokens, SampledTokens]] = []  # every call's prompt and kept action, in turn order
        self.served: list[_Served] = []  # the chat calls, to continue their tokens
        self._texts: list[tuple[str, Tokens]] = []  # text completions: prompt + answer, as text and as tokens
        self.tool_calls = self.invalid_tool_calls = 0
        self.over: StopReason | None = None  # a turn was refused: the turn limit, the context
        self.error: BaseException | None = None  # what failed the episode (a sampler error, a contract error)
        self._responses: dict[str, list[dict[str, Any]]] = {}  # Responses API: id -> the conversation it ended
        self._group: asyncio.TaskGroup | None = None  # the episode's, where calls are sampled
        self._tasks: set[asyncio.Task] = set()  # the calls being sampled
        self._policy: Policy | None = None
        self._agent: anyio.CancelScope | None = None
        self._context: contextvars.Context | None = None  # the episode's: its calls' (the rollout traced, its log)
        self.closed = False

    # -- the episode's side -------------------------------------------------------------------

    def open(self, calls: asyncio.TaskGroup, policy: Policy, agent: anyio.CancelScope) -> None:
        """Serve calls as tasks of ``calls`` (the episode's task group) through ``policy``;
        ``agent`` is cancelled if a call fails the episode. Called in the episode's task: its
        context is each call's, whether the call came in process or over a connection."""
        self._group, self._policy, self._agent = calls, policy, agent
        self._context = contextvars.copy_context()

    def close(self) -> None:
        """No more calls: the pending ones are cancelled (their callers get 410)."""
        self.closed = True
        for task in list(self._tasks):
            task.cancel()

    def metrics(self) -> dict[str, float]:
        """Stitching and tool figures of the episode (``agent/...``)."""
        breaks = rewritten = 0
        for (prompt, action), (following, _) in zip(self.calls, self.calls[1:], strict=False):
            sequence = prompt + action.tokens
            if following[: len(sequence)] != sequence:
                breaks += 1
                rewritten += len(sequence) - _common_prefix(sequence, following)
        calls = len(self.calls)
        out = {
            "agent/calls_per_episode": float(calls),
            "agent/sequences": float(breaks + 1),
            "agent/tokens_rerendered": float(rewritten),
            "agent/tool_calls": float(self.tool_calls),
            "agent/invalid_tool_calls": float(self.invalid_tool_calls),
        }
        if calls > 1:
            out["agent/prefix_extension_rate"] = 1.0 - breaks / (calls - 1)
        if self.over is not None:
            out[f"agent/{self.over.value}"] = 1.0
        return out

    # -- the endpoint's side ------------------------------------------------------------------

    async def chat(self, request: ChatRequest) -> tuple[dict[str, Any], int]:
        turn = await self.turn(request.messages, request.tools, request.read_calls, request.params.max_tokens,
                               request.stop, request.prefill)  # fmt: skip
        logprobs = None
        if request.logprobs:
            logprobs = token_logprobs(turn.answer, self.tokenizer.decode, self.renderer.stop_token_ids)
        body = completion_body(
            f"chatcmpl-{uuid.uuid4().hex}", self.model, turn.version, turn.answer, turn.prompt_tokens, logprobs,
            turn.reply.tool_calls, turn.reply.content,
        )  # fmt: skip
        return body, turn.version

    async def respond(self, request: ResponsesRequest) -> tuple[dict[str, Any], int]:
        """The Responses API: the conversation of ``previous_response_id`` (this episode's), the new
        input, and ``instructions`` before them (never carried over, as OpenAI does)."""
        history: list[dict[str, Any]] = []
        if request.previous_id is not None:
            if request.previous_id not in self._responses:
                raise ApiError(
                    404, f"previous_response_id '{request.previous_id}' is not a response of this episode",
                    "previous_response_id", "previous_response_not_found",
                )  # fmt: skip
            history = self._responses[request.previous_id]
        conversation = [*history, *request.messages]
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        turn = await self.turn([*system, *conversation], request.tools, request.read_calls, request.params.max_tokens)
        rid = f"resp_{uuid.uuid4().hex}"
        said: dict[str, Any] = {"role": "assistant", "content": turn.reply.content}
        if turn.reply.tool_calls:
            said["tool_calls"] = turn.reply.tool_calls
        self._responses[rid] = [*conversation, said]
        reply, ans = turn.reply, turn.answer
        body = response_body(rid, self.model, turn.version, reply.content, reply.tool_calls, ans.finish_reason,
                             turn.prompt_tokens, len(ans.tokens), request)  # fmt: skip
        return body, turn.version

    async def turn(
        self,
        messages: list[dict[str, Any]],
        tools: list[Tool],
        read_calls: bool,
        max_tokens: int,
        stop: Sequence[str] = (),
        prefill: str = "",
    ) -> Turn:
        prompt, history = self._prompt(messages, tools, prefill)

        def record(action: SampledTokens, reply: Reply) -> None:
            said = {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
            self.served.append(_Served(history, _tools_key(tools), prompt, action, message_key(said)))

        return await self._turn(prompt, max_tokens, stop, tools if read_calls else None, record)

    async def complete(self, request: CompletionRequest) -> tuple[dict[str, Any], int]:
        """A text completion: the prompt continued as it is. A prompt whose text is an earlier
        call's prompt + answer + more continues that call's tokens (when the answer did not end
        at a stop token, which its text leaves out); token ids are taken as they are."""
        text = request.prompt if isinstance(request.prompt, str) else None
        prompt: Tokens = [int(t) for t in request.prompt] if text is None else self._text_prompt(text)

        def record(action: SampledTokens, reply: Reply) -> None:
            if text is not None and not (action.tokens and action.tokens[-1] in self.renderer.stop_token_ids):
                self._texts.append((text + reply.content, prompt + action.tokens))

        turn = await self._turn(prompt, request.params.max_tokens, request.stop, None, record)
        pieces = None
        if request.logprobs:
            pieces = [self.tokenizer.decode([t]) for t in turn.answer.tokens if t not in self.renderer.stop_token_ids]
        body = text_completion_body(f"cmpl-{uuid.uuid4().hex}", self.model, turn.version, turn.answer,
                                    turn.prompt_tokens, pieces)  # fmt: skip
        return body, turn.version

    def _text_prompt(self, text: str) -> Tokens:
        for done, tokens in reversed(self._texts):
            if len(text) > len(done) and text.startswith(done):
                return tokens + self.tokenizer.encode(text[len(done) :])
        return self.tokenizer.encode(text)

    async def _turn(
        self, prompt: Tokens, max_tokens: int, stop: Sequence[str], tools: list[Tool] | None, record
    ) -> Turn:
        condition = StopCondition(min(max_tokens, self.max_tokens), self.renderer.stop_token_ids)

        def finish(action: SampledTokens) -> Turn:
            # right as the turn is recorded (same step of the loop): the calls keep the turns' order
            ans = answer(action, self.renderer, stop)
            reply = self.renderer.parse_reply(ans.text, tools)
            self.tool_calls += len(reply.tool_calls)
            self.invalid_tool_calls += reply.invalid
            self.calls.append((prompt, action))
            record(action, reply)
            return Turn(ans, reply, len(prompt), action.policy_version)

        return await self._sample(prompt, condition, lambda s: kept_before_stop(s, self.renderer, stop), finish)

    def _prompt(self, messages: list[dict[str, Any]], tools: list[Tool], prefill: str) -> tuple[Tokens, list[Key]]:
        history = [message_key(m) for m in messages]
        tools_key = _tools_key(tools)
        try:
            if not prefill:
                for s in reversed(self.served):
                    n = len(s.history)
                    if (
                        len(history) > n + 1
                        and s.tools == tools_key
                        and history[n] == s.reply
                        and history[:n] == s.history
                    ):
                        tokens = s.prompt + s.action.tokens
                        if not self.renderer.closes_turn(s.action.tokens):
                            tokens += self.renderer.end_of_turn
                        return tokens + self.renderer.continuation_with_tools(messages[n + 1 :], tools), history  # type: ignore[arg-type]
            prompt = self.renderer.prompt_with_tools(messages, tools)  # type: ignore[arg-type]
        except ValueError as e:  # a role the format does not know, a template that rewrites turns
            raise ApiError(400, str(e), "messages") from None
        return prompt + (self.tokenizer.encode(prefill) if prefill else []), history

    async def _sample(self, prompt: Tokens, stop: StopCondition, keep, finish) -> Turn:
        if self.closed or self._group is None or self._context is None:
            raise EpisodeEnded()
        done: asyncio.Future[Turn] = asyncio.get_running_loop().create_future()
        try:
            task = self._group.create_task(self._serve(prompt, stop, keep, finish, done), context=self._context.copy())
        except RuntimeError:  # the group is shutting down: the episode just ended
            raise EpisodeEnded() from None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await done

    async def _serve(self, prompt: Tokens, stop: StopCondition, keep, finish, done: asyncio.Future) -> None:
        """One call, in the episode's task group; never raises, so no call's error reaches
        another: a refused turn is the caller's answer, any other error fails the episode."""
        assert self._policy is not None
        try:
            turn = finish(await self._policy(prompt, stop, keep))
        except asyncio.CancelledError:
            _settle(done, exception=EpisodeEnded())
            raise
        except EpisodeOver as e:
            self.over = self.over or e.reason
            _settle(done, exception=e)
        except Exception as e:
            if self.error is None:
                self.error = e
            if self._agent is not None:
                self._agent.cancel()
            _settle(done, exception=e)
        else:
            _settle(done, result=turn)


def kept_before_stop(sample: SampledTokens, renderer: Renderer, stop: Sequence[str]) -> int:
    """How many sampled tokens a reply cut at a stop string keeps: those whose text is exactly the
    text before the stop string when a token ends there (a sampler that stops at strings would
    have stopped there), else through the token that completed it (``openai_wire.answer``)."""
    if not stop:
        return len(sample.tokens)
    ans = answer(sample, renderer, stop)
    if ans.finish_reason != "stop" or len(ans.tokens) == len(sample.tokens):
        return len(ans.tokens)
    for k in range(len(ans.tokens), -1, -1):
        text = renderer.parse_response(sample.tokens[:k])[0]["content"]
        if text == ans.text:
            return k
        if len(text) < len(ans.text):
            break
    return len(ans.tokens)


def _settle(done: asyncio.Future, result: Any = None, exception: BaseException | None = None) -> None:
    if done.done():  # its caller went away
        return
    if exception is not None:
        done.set_exception(exception)
    else:
        done.set_result(result)


def _tools_key(tools: list[Tool]) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


def _common_prefix(a: Tokens, b: Tokens) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
