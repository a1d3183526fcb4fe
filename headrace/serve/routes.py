"""The HTTP routes: OpenAI's chat completions and model list, Anthropic's messages, feedback, a
health check and the live rollback; every answer but ``/healthz`` behind the token (when there is
one), sent as ``Authorization: Bearer <token>`` or, as Anthropic's clients send it, ``x-api-key``.
A refusal on ``/v1/messages`` has Anthropic's error body, any other OpenAI's."""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import Callable
from typing import Any

from headrace.core import logs
from headrace.net.anthropic_wire import error_body, message_events, parse_messages
from headrace.net.http import Request, Response, parse_json
from headrace.net.openai_wire import VERSION_HEADER, ApiError, parse_chat, stream_body

from .chain import CHANGES_INCUMBENT
from .lanes import Lane
from .service import Service
from .store import FeedbackError

log = logs.get_logger()
SCENARIO_VERSIONS = re.compile(r"/v1/scenarios/([^/]+)/versions")


class Routes:
    def __init__(self, service: Service, token: str | None):
        self.service = service
        self._token = token.encode() if token else None
        self.http_stats: Callable[[], dict[str, int]] = dict  # the server's connection counts, for /healthz

    def admit(self, request: Request) -> Response | None:
        """The server's pre-body hook: a request without the token is answered 401 on its headers
        alone, so a large body without one is never read."""
        if (request.method, request.path.rstrip("/")) == ("GET", "/healthz"):
            return None
        try:
            self._authorise(request)
        except ApiError as e:
            return _error(e, request)
        return None

    async def __call__(self, request: Request) -> Response:
        try:
            return await self._route(request)
        except ApiError as e:
            return _error(e, request)
        except FeedbackError as e:
            return _error(ApiError(e.status, str(e)), request)
        except Exception as e:  # noqa: BLE001 - a bug answers 500 with a body, and the service goes on
            log.exception("serve_handler_failed", path=request.path)
            return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}"), request)

    async def _route(self, request: Request) -> Response:
        route = (request.method, request.path.rstrip("/"))
        if route == ("GET", "/healthz"):
            serving = self.service.serving
            version = serving.version if serving else None
            health: dict[str, Any] = {"status": "ok", "version": version, "http": self.http_stats()}
            if self.service.per_scenario:
                health["scenarios"] = {
                    name: lane.serving.version if lane.serving else None
                    for name, lane in self.service.lanes.items()
                    if name is not None
                }
            return Response.of_json(health)
        self._authorise(request)  # admit() checked it already, when the server was given that hook
        if route == ("POST", "/v1/chat/completions"):
            return await self._chat(request)
        if route == ("POST", "/v1/messages"):
            return await self._messages(request)
        if route == ("GET", "/v1/models"):
            created = int(self.service.chain.entries[0]["time"]) if self.service.chain.entries else int(time.time())
            name = self.service.model_name
            # OpenAI's fields and Anthropic's side by side: each client reads its own
            model = {"id": name, "object": "model", "created": created, "owned_by": "headrace", "type": "model",
                     "display_name": name, "created_at": _rfc3339(created)}  # fmt: skip
            return Response.of_json(
                {"object": "list", "data": [model], "has_more": False, "first_id": name, "last_id": name}
            )
        if route == ("POST", "/v1/feedback"):
            body = _json(request)
            items = body if isinstance(body, list) else body.get("feedback", [body]) if isinstance(body, dict) else None
            if not isinstance(items, list) or not items:
                raise ApiError(400, 'send {id, reward}, a list of them, or {"feedback": [...]}')
            ids = self.service.feedback(items)
            return Response.of_json({"object": "feedback", "accepted": len(ids), "ids": ids})
        if route == ("POST", "/v1/admin/rollback"):
            body = _json(request)
            body = body if isinstance(body, dict) else {}
            entry = await self.service.rollback(body.get("version"), body.get("scenario"))
            return Response.of_json({"object": "rollback", **entry})
        if route == ("GET", "/v1/versions"):
            return Response.of_json(self._versions(self.service.lanes[None]))
        if request.method == "GET" and (match := SCENARIO_VERSIONS.fullmatch(route[1])):
            return Response.of_json(self._scenario_versions(match[1]))
        raise ApiError(404, f"no route {request.method} {request.path} here", code="unknown_url")

    def _authorise(self, request: Request) -> None:
        if self._token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token):
            return
        key = request.headers.get("x-api-key")
        if key is not None and hmac.compare_digest(key.strip().encode(), self._token):
            return
        raise ApiError(
            401, "missing or wrong API key: send 'Authorization: Bearer <token>' (or 'x-api-key: <token>') with "
            "the server's token", code="invalid_api_key",
        )  # fmt: skip

    async def _chat(self, request: Request) -> Response:
        chat = parse_chat(_object(request), request.headers, self.service.defaults, self.service.model_name)
        out, version = await self.service.complete(chat)
        return _answered(out, version, stream_body if chat.stream else None)

    def _scenario_versions(self, scenario: str) -> dict[str, Any]:
        if not self.service.per_scenario:
            raise ApiError(
                404, "scenarios have no chains of their own here: serve.per_scenario is off, and every scenario "
                "shares the service's versions.jsonl (serve with --set serve.per_scenario=true)", code="unknown_url",
            )  # fmt: skip
        lane = self.service.lanes.get(scenario)
        if lane is None:
            raise ApiError(404, f"no scenario '{scenario}' has been served here, so it has no versions", "scenario")
        return self._versions(lane)

    def _versions(self, lane: Lane) -> dict[str, Any]:
        """A chain's lines (``completions`` a count), each published one with its ``handoff`` to a
        separate sampler (vLLM) once a request has asked for it."""
        incumbent = lane.chain.incumbent()
        lines = []
        for e in lane.chain.entries:
            line = {k: v for k, v in e.items() if k not in ("completions", "baselines")}
            line["completions"] = len(e.get("completions", ()))
            if e["outcome"] in CHANGES_INCUMBENT and (handoff := self.service.handoff(e["version"], lane.name)):
                line["handoff"] = {k: v for k, v in handoff.items() if k not in ("version", "scope")}
            lines.append(line)
        return {"object": "list", "scenario": lane.name, "incumbent": incumbent.version if incumbent else None,
                "data": lines}  # fmt: skip

    async def _messages(self, request: Request) -> Response:
        chat = parse_messages(_object(request), request.headers, self.service.defaults, self.service.model_name)
        out, version = await self.service.message(chat)
        return _answered(out, version, message_events if chat.stream else None)


def _object(request: Request) -> dict[str, Any]:
    body = _json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _answered(out: Any, version: int, events: Callable[[Any], Any] | None) -> Response:
    """The answer as JSON, or as server-sent events when ``events`` (the API's stream format) is given;
    the serving version in its header either way."""
    response = Response(body=events(out), content_type="text/event-stream") if events else Response.of_json(out)
    response.headers[VERSION_HEADER] = str(version)
    return response


def _rfc3339(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _json(request: Request) -> Any:
    try:
        return parse_json(request.body)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _error(error: ApiError, request: Request) -> Response:
    anthropic = request.path.rstrip("/") == "/v1/messages"
    return Response.of_json(error_body(error) if anthropic else error.body(), status=error.status)
