"""A small HTTP/1.1 server on asyncio streams and ``h11`` (already installed with httpx).

Why not a framework: the emulator must be able to *drop* a response (close the connection after
the request was read and acted on), which is the fault the SDK's retries and headrace's
exactly-once recovery exist for. Owning the connection loop makes that one line, and adds no
dependency.

A handler gets a ``Request`` and returns a ``Response`` or ``DROP``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11

log = logging.getLogger(__name__)

MAX_BODY = 512 * 1024 * 1024


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"{}")


@dataclass
class Response:
    status: int = 200
    body: bytes = b"{}"
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_json(cls, payload: Any, status: int = 200) -> Response:
        return cls(status=status, body=json.dumps(payload).encode())

    @classmethod
    def of_proto(cls, payload: bytes) -> Response:
        return cls(body=payload, content_type="application/x-protobuf")

    @classmethod
    def error(cls, status: int, message: str) -> Response:
        # The SDK treats a 400 with an empty body as a proxy reject: errors always carry a body.
        return cls.of_json({"detail": message, "error": message}, status=status)


DROP = object()  # a handler's return value: close the connection without answering

Handler = Callable[[Request], Awaitable["Response | object"]]


class HttpServer:
    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0):
        self._handler = handler
        self._host = host
        self._port = port
        self._server: asyncio.AbstractServer | None = None
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
        task = self._group.create_task(self._connection(reader, writer), name="tinker-emulator-connection")
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, h11.RemoteProtocolError):
            pass  # the client went away: nothing to answer
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
            try:
                result = await self._handler(request)
            except Exception as e:  # a handler bug must still answer, with a body
                log.exception("emulator handler failed on %s %s", request.method, request.path)
                result = Response.error(500, f"emulator error: {type(e).__name__}: {e}")
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
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    @staticmethod
    async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader) -> Request | None:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(256 * 1024)
                conn.receive_data(data)  # b"" marks EOF
                if not data and conn.their_state in (h11.IDLE, h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                    return None
                continue
            if isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    raise h11.RemoteProtocolError("request body too large")
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                headers = {k.decode().lower(): v.decode("latin-1") for k, v in head.headers}
                target = head.target.decode()
                return Request(head.method.decode(), target.split("?", 1)[0], headers, bytes(body))
            elif isinstance(event, h11.ConnectionClosed | h11.PAUSED):
                return None
