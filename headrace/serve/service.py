"""The service: an OpenAI-compatible (and Anthropic Messages) endpoint over each lane's incumbent
version, with the candidates trained behind it (``lanes.py``).

Requests, not a dataset, feed the sampler; feedback, not an env, gives the rewards; the training
backend and the sampler are the ones ``headrace run`` uses. Each request reads its lane's
incumbent once, so it is served wholly by one version, and is captured (``store.py``) before its
response leaves; scored, it joins its lane's pool of completions a candidate trains on. Routes are
in ``routes.py``.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from headrace.core.protocols import Backend
from headrace.net.anthropic_wire import message_body
from headrace.net.openai_wire import Answer, ApiError, ChatRequest, answer, completion_body, token_logprobs
from headrace.renderers import renderer_for
from headrace.renderers.tools import Reply
from headrace.run.config import RunConfig

from .lanes import Lane, Lanes, Serving, check_per_scenario
from .store import Completion

__all__ = ["Lane", "Served", "Service", "Serving", "check_per_scenario"]


@dataclasses.dataclass(frozen=True)
class Served:
    """One answer, sampled and captured: what either API's response is written from."""

    id: str
    version: int
    answer: Answer
    prompt_tokens: int
    reply: Reply


class Service(Lanes):
    def __init__(self, config: RunConfig, backend: Backend, run_dir: Path, say: Callable[[str], None] = print):
        """``say``: one line for the operator each time the incumbent changes (or a candidate fails)."""
        super().__init__(config, backend, run_dir, say)
        options = self.options
        self.model_name = options.model_name or config.model
        self.renderer = renderer_for(config.model, backend.tokenizer, config.renderer)
        self.max_context = options.max_context or self.sampler.max_context
        self.defaults = config.sampling.params()
        self.invalid_tool_calls = 0  # replies that tried to call a tool and failed (returned as text)
        self._limiter = anyio.CapacityLimiter(options.max_concurrency)

    # -- serving ---------------------------------------------------------------------------

    async def complete(self, request: ChatRequest) -> tuple[dict[str, Any], int]:
        """A chat completion (OpenAI's body) and the version that served it."""
        served = await self.serve(request, "chatcmpl-")
        logprobs = None
        if request.logprobs:
            logprobs = token_logprobs(served.answer, self.backend.tokenizer.decode, self.renderer.stop_token_ids)
        reply = served.reply
        body = completion_body(
            served.id, self.model_name, served.version, served.answer, served.prompt_tokens, logprobs,
            reply.tool_calls, reply.content,
        )  # fmt: skip
        return body, served.version

    async def message(self, request: ChatRequest) -> tuple[dict[str, Any], int]:
        """An Anthropic message (``/v1/messages``) and the version that served it: served and
        captured as a chat completion is, under an id of Anthropic's form."""
        served = await self.serve(request, "msg_")
        return message_body(served.id, self.model_name, served.version, served.answer, served.prompt_tokens), (
            served.version
        )

    async def serve(self, request: ChatRequest, id_prefix: str) -> Served:
        """Sample one answer with the incumbent and capture it (before the response leaves)."""
        serving = (await self.lane(request.scenario)).serving  # read once: the whole request is served by it
        assert serving is not None, "start() first"
        try:
            renderer = self.renderer.with_template_kwargs(request.template_kwargs)
        except ValueError as e:
            raise ApiError(400, str(e), "chat_template_kwargs") from None
        try:
            prompt = renderer.prompt_with_tools(request.messages, request.tools)  # type: ignore[arg-type]
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:  # noqa: BLE001 - a template that fails on these variables is the request's problem
            if not request.template_kwargs:
                raise
            raise ApiError(
                400, f"the chat template failed with these chat_template_kwargs: {type(e).__name__}: {e}",
                "chat_template_kwargs",
            ) from None  # fmt: skip
        if request.prefill:
            prompt += self.backend.tokenizer.encode(request.prefill)
        if self.max_context is not None and len(prompt) >= self.max_context:
            raise ApiError(
                400,
                f"the prompt is {len(prompt)} tokens, and this model's context is {self.max_context} tokens "
                "(prompt and answer together); shorten the messages",
                "messages",
                "context_length_exceeded",
            )
        params = dataclasses.replace(request.params, stop_token_ids=self.renderer.stop_token_ids)
        async with self._limiter:
            sample = (await self.sampler.sample(prompt, 1, params, handle=serving.handle))[0]
        ans = answer(sample, self.renderer, request.stop)
        # the reply's tool calls; one the model got wrong comes back as text, and is counted
        reply = self.renderer.parse_reply(ans.text, request.tools if request.read_calls else None)
        self.invalid_tool_calls += reply.invalid
        cid = f"{id_prefix}{uuid.uuid4().hex}"
        completion = Completion(
            cid, serving.version, serving.epoch, prompt, ans.tokens, ans.logprobs, ans.finish_reason, ans.text,
            request.scenario,
        )  # fmt: skip
        self.store.add(completion)
        return Served(cid, serving.version, ans, len(prompt), reply)

    def feedback(self, items: list[Any]) -> list[str]:
        """Score completions: every item is checked before any is kept, so a refused list keeps nothing."""
        checked, seen = [], set()
        for item in items:
            if not isinstance(item, dict):
                raise ApiError(400, f"a feedback item must be an object {{id, reward}}, got {item!r}")
            completion, reward = self.store.check_feedback(item.get("id"), item.get("reward"))
            if completion.id in seen:
                raise ApiError(409, f"completion '{completion.id}' is scored twice in this request", code="duplicate")
            seen.add(completion.id)
            checked.append((completion, reward))
        for completion, reward in checked:
            self.store.score(completion, reward)
            self.lanes[self.lane_key(completion.scenario)].pending[completion.id] = completion
        self._scored.set()
        return [c.id for c, _ in checked]
