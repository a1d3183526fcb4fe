"""Pairwise judges: which of two responses to a prompt is better.

A :class:`Judge` answers ``await judge.prefer(prompt, a, b)`` with the probability that ``a`` is
the better one (1.0: a, 0.0: b, 0.5: a tie), or None when it gave no usable verdict. Two come
with headrace:

- :class:`OpenAIJudge`: any OpenAI-compatible chat endpoint (vLLM, llama.cpp's server, a hosted
  API) through the official ``openai`` client (``pip install 'headrace[judge]'``), asked to answer
  ``A`` or ``B``;
- :class:`ShorterJudge`: prefers the shorter response, as the cookbook's toy preference recipe
  does: a judge with a known optimum, for trying the machinery without an endpoint.

Judges are plain picklable objects: the HTTP client is made on first use, once per event loop.
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SYSTEM = (
    "You compare two responses to the same prompt and say which is better: more helpful, correct and "
    "clear. Answer with the single letter A or B."
)
TEMPLATE = "Prompt:\n{prompt}\n\nResponse A:\n{a}\n\nResponse B:\n{b}\n\nWhich response is better? Answer A or B."
_VERDICT = re.compile(r"\b([AB])\b")


@runtime_checkable
class Judge(Protocol):
    async def prefer(self, prompt: str, a: str, b: str) -> float | None:
        """The probability that ``a`` is the better response (1: a, 0: b, 0.5: a tie); None: no verdict."""
        ...


def parse_verdict(text: str) -> float | None:
    """1.0 for an answer that names A first, 0.0 for B; None when it names neither."""
    match = _VERDICT.search(text.strip())
    return None if match is None else float(match.group(1) == "A")


@dataclass(frozen=True)
class ShorterJudge:
    async def prefer(self, prompt: str, a: str, b: str) -> float | None:
        return 0.5 if len(a) == len(b) else float(len(a) < len(b))


@dataclass
class OpenAIJudge:
    """``model`` at ``base_url`` (e.g. ``http://127.0.0.1:8000/v1``), greedy, a few tokens. The key
    is read from the environment variable ``api_key_env`` (a local server needs none). An answer
    naming neither letter is no verdict (None); an endpoint that fails raises (the engine drops
    that group and counts the error)."""

    base_url: str
    model: str
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 60.0
    max_retries: int = 2
    _clients: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_clients": {}}  # clients hold sockets and a loop: never pickled

    def _client(self) -> Any:
        loop = id(asyncio.get_running_loop())
        if loop not in self._clients:
            try:
                import openai
            except ImportError:
                raise RuntimeError(
                    "the OpenAI-compatible judge needs the openai client: pip install 'headrace[judge]'"
                ) from None
            self._clients = {
                loop: openai.AsyncOpenAI(  # one loop at a time: drop clients of finished loops
                    base_url=self.base_url,
                    api_key=os.environ.get(self.api_key_env) or "EMPTY",
                    timeout=self.timeout_s,
                    max_retries=self.max_retries,
                )
            }
        return self._clients[loop]

    async def prefer(self, prompt: str, a: str, b: str) -> float | None:
        response = await self._client().chat.completions.create(
            model=self.model,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": TEMPLATE.format(prompt=prompt, a=a, b=b)},
            ],
            temperature=0.0,
            max_tokens=4,
        )
        return parse_verdict(response.choices[0].message.content or "") if response.choices else None
