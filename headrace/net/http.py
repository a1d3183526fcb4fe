"""A small HTTP/1.1 server on asyncio streams and ``h11`` (already installed with httpx).

Why not a framework: the Tinker emulator must be able to *drop* a response (close the connection after
the request was read and acted on), which is the fault the SDK's retries and headrace's
exactly-once recovery exist for. Owning the connection loop makes that one line, and adds no
dependency.

A handler gets a ``Request`` and returns a ``Response`` or ``DROP``. Limits, read on every
request (the emulator's knobs can change while it runs): a body over ``max_body_mib`` is answered 413 as soon as its
size is known (nothing more of it is kept), a keep-alive connection with no request for
``idle_connection_s`` is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import h11

log = logging.getLogger(__name__)

LINGER_S = 1.0  # after a 413, the rest of the body is read and thrown away this long, so the client sees the answer


class Limits(Protocol):
    max_body_mib: float
    idle_connection_s: float


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes

    too_large: bool = False  # the body went over the limit and was not kept

    def json(self) -> dict[str, Any]:
        """The body as a JSON object; ``ValueError`` (a client error) for anything else."""
        try:
            value = json.loads(self.body or b"{}")
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"the request body is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"the request body must be a JSON object, not {type(value).__name__}")
        return value


@dataclass
class Response:
    status: int = 200
    body: bytes = b"{}"
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_json(cls, payload: Any, status: int = 200) -> Response:
        return cls(status=status, body=json.dumps(_finite_json(payload), allow_nan=False).encode())

    @classmethod
    def of_proto(cls, payload: bytes) -> Response:
        return cls(body=payload, content_type="application/x-protobuf")

    @classmethod
    def error(cls, status: int, message: str) -> Response:
        # The SDK treats a 400 with an empty body as a proxy reject: errors always carry a body.
        return cls.of_json({"detail": message, "error": message}, status=status)


def _finite_json(value: Any) -> Any:
    """NaN and infinities as the strings "NaN", "Infinity", "-Infinity": bare ``NaN`` is not JSON
    (the SDK's parser refuses it), while its pydantic models read these strings back as floats."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


DROP = object()  # a handler's return value: close the connection without answering

Handler = Callable[[Request], Awaitable["Response | object"]]


class HttpServer:
    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: Limits | None = None,
        name: str = "the emulator",
    ):
        self._handler = handler
        self.name = name  # how errors name the server
        self._limits = limits
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._group: asyncio.TaskGroup | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return self._server.sockets[0].getsockname()[1]

    async def start(self, group: asyncio.TaskGroup) -> None:
        """Serve each connection as a task of ``group``: asyncio's own per-connection task (3.11)
        logs a spurious error when it is cancelled, so it only hands the connection over."""
        self._group = group
        self._server = await asyncio.start_server(self._on_connect, self._host, self._port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._group is not None, "server not started"
        task = self._group.create_task(self._connection(reader, writer), name=f"{self.name} connection")
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, h11.RemoteProtocolError, TimeoutError):
            pass  # the client went away, broke the protocol or fell silent: nothing to answer
        finally:  # a cancellation (close() ending the connection) passes through
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        while True:
            request = await self._read_request(conn, reader)
            if request is None:
                return
            if request.too_large:
                too_large = Response.error(
                    413,
                    f"the request body is over {self.name}'s limit of {self._max_body()} bytes (max_body_mib)",
                )
                too_large.headers["connection"] = "close"
                result: Response | object = too_large
            else:
                try:
                    result = await self._handler(request)
                except Exception as e:  # a handler bug must still answer, with a body
                    log.exception("%s: handler failed on %s %s", self.name, request.method, request.path)
                    result = Response.error(500, f"{self.name}: internal error: {type(e).__name__}: {e}")
            if result is DROP:
                writer.transport.abort()
                return
            assert isinstance(result, Response)
            headers = [
                ("content-type", result.content_type),
                ("content-length", str(len(result.body))),
                *result.headers.items(),
            ]
            writer.write(conn.send(h11.Response(status_code=result.status, headers=headers)))
            writer.write(conn.send(h11.Data(data=result.body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            if request.too_large:
                await self._linger(reader)
                return
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    @staticmethod
    async def _linger(reader: asyncio.StreamReader) -> None:
        """Read and drop what the client is still sending, briefly: closing on unread data would
        reset the connection before the client reads the 413."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(LINGER_S):
                while await reader.read(256 * 1024):
                    pass

    def _max_body(self) -> int:
        return int(self._limits.max_body_mib * 2**20) if self._limits else 32 * 2**20

    async def _read_request(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Request | None:
        head: h11.Request | None = None
        body = bytearray()
        limit = self._max_body()
        idle_s = (self._limits.idle_connection_s if self._limits else 0) or None
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                # between requests and within one: a silent client is cut after idle_s
                data = await asyncio.wait_for(reader.read(256 * 1024), idle_s)
                conn.receive_data(data)  # b"" marks EOF
                if not data and conn.their_state in (h11.IDLE, h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                    return None
                continue
            if isinstance(event, h11.Request):
                head = event
                length = dict(event.headers).get(b"content-length", b"0")
                if length.isdigit() and int(length) > limit:
                    return self._request(head, b"", too_large=True)
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > limit:  # a chunked body, over the limit
                    return self._request(head, b"", too_large=True)
            elif isinstance(event, h11.EndOfMessage):
                return self._request(head, bytes(body))
            elif isinstance(event, h11.ConnectionClosed | h11.PAUSED):
                return None

    @staticmethod
    def _request(head: h11.Request | None, body: bytes, too_large: bool = False) -> Request:
        assert head is not None
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in head.headers}
        return Request(head.method.decode(), head.target.decode().split("?", 1)[0], headers, body, too_large)
