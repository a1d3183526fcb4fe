"""The agents' endpoint: an OpenAI-compatible server on loopback, one base_url per episode.

An episode's agent gets ``base_url = http://127.0.0.1:PORT/agents/<episode>/v1`` and the run's key
(a fresh random token, sent as ``Authorization: Bearer``), and calls ``chat/completions``,
``responses``, ``completions`` (text, or token ids) or ``models`` under it; each call is routed
to its own episode (``bridge.py``), so concurrent episodes never mix. A call for an episode that
is over (its agent returned, it timed out, its group gave up) gets 404, or 410 when it was
already waiting.

One server serves the run (``lifespan``: the dataset's, entered by the run for its whole life);
an episode run outside a run (a test, an evaluation on its own) gets a server of its own for its
length. Either way the server's connections are tasks of a task group that outlives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import re
import secrets
import ssl
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx

from headrace.core import logs
from headrace.core.episode import EpisodeOver
from headrace.core.types import SamplingParams, StopReason
from headrace.net.http import HttpServer, Request, Response
from headrace.net.inprocess import InProcessTransport
from headrace.net.limits import ServerLimits
from headrace.net.openai_completions import parse_completion, text_stream_body
from headrace.net.openai_responses import parse_responses, response_events
from headrace.net.openai_wire import VERSION_HEADER, ApiError, parse_chat, stream_body
from headrace.renderers import Renderer

from .bridge import EpisodeBridge, EpisodeEnded

log = logs.get_logger()
ROUTE = re.compile(r"/agents/([A-Za-z0-9_-]+)/v1/(chat/completions|responses|completions|models)")
# The run's agents share POOLS connection pools of POOL_CONNECTIONS each, an episode's calls on one
# of them (round robin). Not one large pool: httpcore scans every connection of a pool (twice
# over, its idle count is quadratic) each time a request enters or leaves it, which at 64
# connections cost more CPU than all the rest of a call. More calls than connections wait in a
# pool, not in the listen backlog, which is as deep as the pools are wide.
POOLS, POOL_CONNECTIONS = 64, 4
# an agent may think or run a tool for minutes between two calls on one kept-alive connection: it
# is not closed under it (its client, with no retries, would see a connection error)
LIMITS = ServerLimits(idle_connection_s=600.0)


class AgentEndpoint:
    def __init__(self, renderer: Renderer, tokenizer: Any, max_tokens: int, model: str, host: str = "127.0.0.1"):
        self.renderer, self.tokenizer, self.max_tokens, self.model, self.host = (
            renderer, tokenizer, max_tokens, model, host
        )  # fmt: skip
        self.key = secrets.token_urlsafe(24)  # the run's API key: nothing else on this machine can call in
        self.defaults = SamplingParams(max_tokens=max_tokens)
        self._episodes: dict[str, EpisodeBridge] = {}
        self._server: HttpServer | None = None
        self._pools: list[Any] = []  # the run's HTTP connection pools for the agents' openai clients
        self._next_pool = 0
        self._inprocess: Any = None  # the in-process client (http_client)

    def __getstate__(self) -> dict[str, Any]:
        # a group builder is pickled with its endpoint (--cluster ray): the running parts stay here
        return {**self.__dict__, "_episodes": {}, "_server": None, "_pools": [], "_inprocess": None}

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """The run's server, for as long as the run lives."""
        async with self._serving() as server:
            self._server = server
            try:
                yield
            finally:
                self._server = None
                pools, self._pools = self._pools, []
                with anyio.CancelScope(shield=True):  # closed even when the run is cancelled
                    for pool in pools:
                        await pool.shutdown()

    def http_client(self) -> Any:
        """The httpx client of ``AgentEpisode.openai()``'s clients: one that hands each call to
        this endpoint in this process (``net/inprocess.py``), the same answer as over loopback
        without a connection or HTTP on either side, so it serves only clients on the run's
        event loop (an async agent's). Closing an episode's client leaves it open."""
        if self._inprocess is None:
            transport = InProcessTransport(self, LIMITS, "the agent endpoint", self.admit)
            self._inprocess = shared_http_client(transport=transport)
        return self._inprocess

    def loopback_client(self) -> Any:
        """One of the run's connection pools to the endpoint's port, for ``AgentEpisode.openai(loopback=True)``
        (None outside a run): a client of its own would cost each episode an SSL context (~25 ms
        of CPU here) and new connections. Closing an episode's client leaves it open."""
        if self._server is None:
            return None
        if len(self._pools) < POOLS:
            self._pools.append(shared_http_client())
            return self._pools[-1]
        self._next_pool = (self._next_pool + 1) % POOLS
        return self._pools[self._next_pool]

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[tuple[EpisodeBridge, str]]:
        """An episode's bridge and its base_url, routed while the block lasts."""
        bridge = EpisodeBridge(secrets.token_urlsafe(16), self.renderer, self.tokenizer, self.max_tokens, self.model)
        async with contextlib.AsyncExitStack() as stack:
            server = self._server
            if server is None:  # outside a run: a server of its own, for this episode's length
                server = await stack.enter_async_context(self._serving())
            self._episodes[bridge.id] = bridge
            try:
                yield bridge, f"http://{self.host}:{server.port}/agents/{bridge.id}/v1"
            finally:
                del self._episodes[bridge.id]

    @contextlib.asynccontextmanager
    async def _serving(self) -> AsyncIterator[HttpServer]:
        async with asyncio.TaskGroup() as connections:
            server = HttpServer(
                self, self.host, 0, limits=LIMITS, name="the agent endpoint", admit=self.admit,
                backlog=POOLS * POOL_CONNECTIONS,
            )  # fmt: skip
            await server.start(connections)
            try:
                yield server
            finally:
                with anyio.CancelScope(shield=True):
                    await server.close()

    def admit(self, request: Request) -> Response | None:
        """The server's pre-body hook: a call without the run's key is answered 401 on its
        headers alone, its body never read."""
        if ROUTE.fullmatch(request.path.rstrip("/")) is None:
            return None  # /healthz, or a 404 that names the right route
        try:
            self._authorise(request)
        except ApiError as e:
            return Response.of_json(e.body(), status=e.status)
        return None

    async def __call__(self, request: Request) -> Response:
        try:
            return await self._route(request)
        except ApiError as e:
            return Response.of_json(e.body(), status=e.status)
        except Exception as e:  # noqa: BLE001 - a bug answers 500 with a body; the other episodes go on
            log.exception("agent_endpoint_failed", path=request.path)
            return Response.of_json(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status=500)

    async def _route(self, request: Request) -> Response:
        path = request.path.rstrip("/")
        if path == "/healthz":
            return Response.of_json({"status": "ok", "episodes": len(self._episodes)})
        route = ROUTE.fullmatch(path)
        if route is None:
            raise ApiError(
                404, f"no route {request.method} {request.path} here; an agent's base_url is "
                "http://HOST:PORT/agents/<episode>/v1 (AgentEpisode.base_url)", code="unknown_url",
            )  # fmt: skip
        self._authorise(request)
        bridge = self._episodes.get(route.group(1))
        if bridge is None:
            raise ApiError(
                404, f"no live episode '{route.group(1)}': its agent returned, it timed out or its group was "
                "cancelled, so it takes no more calls (each episode has its own base_url)", code="episode_not_found",
            )  # fmt: skip
        what = route.group(2)
        if what == "models":
            model = {"id": self.model, "object": "model", "created": 0, "owned_by": "headrace"}
            return Response.of_json({"object": "list", "data": [model]})
        if request.method != "POST":
            raise ApiError(405, f"{what} takes POST, not {request.method}")
        body = _json(request)
        try:
            if what == "chat/completions":
                chat = parse_chat(body, request.headers, self.defaults, None)
                out, version = await bridge.chat(chat)
                stream = chat.stream
                payload = stream_body(out) if stream else None
            elif what == "completions":
                text = parse_completion(body, self.defaults)
                out, version = await bridge.complete(text)
                stream = text.stream
                payload = text_stream_body(out) if stream else None
            else:
                responses = parse_responses(body, self.defaults)
                out, version = await bridge.respond(responses)
                stream = responses.stream
                payload = response_events(out) if stream else None
        except EpisodeOver as e:
            code = "context_length_exceeded" if e.reason is StopReason.CONTEXT_OVERFLOW else "turn_limit"
            raise ApiError(400, f"{e}: the episode takes no more calls; end the agent's loop", code=code) from None
        except EpisodeEnded:
            raise ApiError(410, "the episode ended while this call waited (its agent returned, it timed out or its "
                           "group was cancelled)", code="episode_ended") from None  # fmt: skip
        except Exception as e:
            if e is bridge.error:  # the episode failed on this call (the sampler, a contract): it ends
                raise ApiError(500, f"the episode failed: {type(e).__name__}: {e}", code="episode_failed") from None
            raise
        response = Response(body=payload, content_type="text/event-stream") if payload else Response.of_json(out)
        response.headers[VERSION_HEADER] = str(version)
        return response

    def _authorise(self, request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.key.encode()):
            raise ApiError(
                401, "missing or wrong API key: send the episode's api_key (AgentEpisode.api_key) as "
                "'Authorization: Bearer <key>'", code="invalid_api_key",
            )  # fmt: skip


def shared_http_client(transport: Any = None) -> Any:
    """An httpx client for the openai SDK (its own httpx flavour), whose ``aclose`` leaves it open:
    over ``transport``, or over loopback connections, bounded: a few hundred episodes opening
    theirs at once on a busy loop overflow the server's listen backlog and meet the SDK's 5 s
    connect timeout."""
    import openai

    class SharedHttpClient(openai.DefaultAsyncHttpxClient):
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self._none = _NoCookies()

        async def aclose(self) -> None:  # an episode's client is closed: the run's pool stays
            return None

        # The endpoint sets no cookie (and one jar would mix the episodes' up), while httpx reads
        # every response into the client's jar: a urllib request built per call, ~5% of its CPU.
        @property
        def cookies(self) -> httpx.Cookies:
            return self._none

        @cookies.setter
        def cookies(self, cookies: Any) -> None:
            raise TypeError("the agents' shared HTTP client keeps no cookies: the endpoint sets none")

        async def shutdown(self) -> None:
            await super().aclose()

    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
        max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS
    )
    if transport is not None:
        return SharedHttpClient(transport=transport)
    return SharedHttpClient(limits=limits, verify=_ssl_context())


class _NoCookies(httpx.Cookies):
    """Empty, and stays so: what a response sets is dropped (the endpoint sets nothing)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None

    def set_cookie_header(self, request: httpx.Request) -> None:
        return None


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One for all the pools (the endpoint is http://, but httpx builds a context per client, ~25 ms)."""
    return ssl.create_default_context()


def _json(request: Request) -> dict[str, Any]:
    try:
        return request.json()  # an object, or the ValueError that says what it is instead
    except ValueError as e:
        raise ApiError(400, str(e)) from None
