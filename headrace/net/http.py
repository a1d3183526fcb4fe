"""A small HTTP/1.1 server on asyncio streams and ``h11`` (already installed with httpx).

Why not a framework: the Tinker emulator must be able to *drop* a response (close the connection after
the request was read and acted on), which is the fault the SDK's retries and headrace's
exactly-once recovery exist for. Owning the connection loop makes that one line, and adds no
dependency.

A handler gets a ``Request`` and returns a ``Response`` or ``DROP``; an ``admit`` hook sees the
request's head before its body is read and may answer it instead (``headrace serve`` checks its
token there, so a large body without one is never read). A ``HEAD`` is handled as the ``GET`` it
asks about and answered with the headers only. The limits (``limits.py``) are read on every
connection and request, since the emulator's knobs can change while it runs.

No error on one connection ends the server or reaches another connection: a request ``h11``
rejects is answered with the 4xx it hints at (when HTTP still allows an answer) and its connection
closed; a timeout or any other failure closes that connection only. Each is counted in ``stats``
and logged (``limits.Tally``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11

from .limits import BACKLOG, Limits, ServerLimits, Tally, descriptor_room

LINGER_S = 1.0  # after a refusal, what the client still sends is read and thrown away this long, so it sees the answer
CHUNK = 256 * 1024
MAX_HEAD = 64 * 1024  # a request line and headers larger than this are refused (431)


def parse_json(body: bytes) -> Any:
    """The body as JSON (empty: ``{}``); ``ValueError`` (a client error) naming what is wrong."""
    try:
        return json.loads(body or b"{}")
    except RecursionError:
        raise ValueError("the request body is JSON nested too deeply to read") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the request body is not valid JSON ({e})") from None


@dataclass
class Request:
    method: str  # a HEAD arrives as "GET" (``headers_only`` set)
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes
    headers_only: bool = False  # a HEAD: answered with the headers of the GET, no body

    def json(self) -> dict[str, Any]:
        """The body as a JSON object; ``ValueError`` (a client error) for anything else."""
        value = parse_json(self.body)
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
        try:  # most answers hold no NaN: written at once, not walked first (every agent call is one)
            body = json.dumps(payload, allow_nan=False)
        except ValueError:
            body = json.dumps(_finite_json(payload), allow_nan=False)
        return cls(status=status, body=body.encode())

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
Admit = Callable[[Request], "Response | None"]  # sees the head (body empty); a Response answers instead


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A whole response written before any request was read (no h11 state to go through)."""
    body = json.dumps({"detail": message, "error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\nretry-after: 1\r\n\r\n"
    )
    return head.encode() + body


class HttpServer:
    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: Limits | None = None,
        name: str = "the emulator",
        admit: Admit | None = None,
        backlog: int = BACKLOG,
    ):
        self._handler, self._admit = handler, admit
        self.name = name  # how errors name the server
        self._limits: Limits = limits if limits is not None else ServerLimits()
        self._host = host
        self._backlog = backlog  # connections the kernel queues for accept() (the clients' own pool may be wider)
        self._port = port
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._group: asyncio.TaskGroup | None = None
        self._room = 1 << 30  # connections the open-file limit leaves room for (measured at start)
        self.tally = Tally(name)

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return self._server.sockets[0].getsockname()[1]

    @property
    def stats(self) -> dict[str, int]:
        """Connections open now, the most served at once, and what was refused or cut so far, by kind."""
        return {"open": len(self._conns), "capacity": self.capacity(), **self.tally.counts}

    def capacity(self) -> int:
        return max(1, min(self._limits.max_connections, self._room))

    async def start(self, group: asyncio.TaskGroup) -> None:
        """Serve each connection as a task of ``group``: asyncio's own per-connection task (3.11)
        logs a spurious error when it is cancelled, so it only hands the connection over."""
        self._group = group
        self._room = descriptor_room()
        self._server = await asyncio.start_server(self._on_connect, self._host, self._port, backlog=self._backlog)
        if self._room < self._limits.max_connections:
            self.tally.say(
                f"serves at most {self.capacity()} connections at once (max_connections is "
                f"{self._limits.max_connections}, and the open-file limit, ulimit -n, leaves room for "
                f"{self._room}); raise the limit to serve more"
            )

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
        if len(self._conns) >= self.capacity():
            message = f"{self.name} is serving the most connections it takes at once ({self.capacity()}); retry"
            self.tally.note("over_capacity", message)
            writer.write(_raw_error(503, "Service Unavailable", message))
            writer.close()  # the answer is flushed, then the socket closed: its descriptor is back at once
            return
        task = self._group.create_task(self._connection(reader, writer), name=f"{self.name} connection")
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except TimeoutError:
            self.tally.count("timed_out")  # silent past a limit: the idle wait, the head, a body, a write
        except Exception as e:  # noqa: BLE001 - one connection's failure ends that connection, never the server
            self.tally.note("connection_failed", f"a connection failed and was closed: {type(e).__name__}: {e}", e)
        finally:  # a cancellation (close() ending the connection) passes through
            writer.close()
            try:
                async with asyncio.timeout(LINGER_S):
                    await writer.wait_closed()
            except (TimeoutError, OSError):
                writer.transport.abort()  # a client that reads nothing cannot hold its connection open

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        first = True
        while True:
            request: Request | None = None
            try:
                head = await self._read_head(conn, reader, first)
                if head is None:
                    return
                request = _request(head)
                refusal = self._refusal(request)
                if refusal is None:
                    if conn.they_are_waiting_for_100_continue:
                        writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                    body = await self._read_body(conn, reader)
                    refusal = self._too_large() if body is None else None
                    request.body = body or b""
            except h11.RemoteProtocolError as e:
                await self._answer_malformed(conn, reader, writer, e, request is not None and request.headers_only)
                return
            if refusal is not None:  # the body was not read (or not kept): the connection cannot go on
                refusal.headers["connection"] = "close"
                await self._send(conn, writer, refusal, request.headers_only)
                await self._linger(reader)
                return
            result = await self._handle(request)
            if result is DROP:
                writer.transport.abort()
                return
            assert isinstance(result, Response)
            await self._send(conn, writer, result, request.headers_only)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return
            first = False

    async def _handle(self, request: Request) -> Response | object:
        try:
            return await self._handler(request)
        except Exception as e:  # a handler bug must still answer, with a body
            self.tally.note("handler_failed", f"the handler failed on {request.method} {request.path}", e)
            return internal_error(self.name, e)

    def _refusal(self, request: Request) -> Response | None:
        """The answer to a request refused on its head alone: a body over the limit, or ``admit``'s."""
        length = request.headers.get("content-length", "0")
        if length.isdigit() and int(length) > self._max_body():
            return self._too_large()
        if self._admit is None:
            return None
        try:
            refusal = self._admit(request)
        except Exception as e:  # noqa: BLE001 - as a handler's bug: answered 500
            self.tally.note("handler_failed", f"admit failed on {request.method} {request.path}", e)
            return internal_error(self.name, e)
        if refusal is not None:
            self.tally.count("refused_before_body")
        return refusal

    def _too_large(self) -> Response:
        self.tally.count("too_large")
        return too_large(self.name, self._limits)

    async def _send(self, conn: h11.Connection, writer: asyncio.StreamWriter, response: Response, head: bool) -> None:
        headers = [
            ("content-type", response.content_type),
            ("content-length", str(len(response.body))),
            *response.headers.items(),
        ]
        writer.write(conn.send(h11.Response(status_code=response.status, headers=headers)))
        if not head:  # a HEAD's answer is the GET's headers, its content-length included, and no body
            writer.write(conn.send(h11.Data(data=response.body)))
        writer.write(conn.send(h11.EndOfMessage()))
        async with asyncio.timeout(self._idle_s()):  # a client that stops reading is cut like a silent one
            await writer.drain()

    async def _answer_malformed(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        e: h11.ProtocolError,
        head: bool,
    ) -> None:
        """A request h11 refused: answered with the status h11 hints at (400, 431 for a huge head,
        501 for an unknown transfer coding) where HTTP still allows an answer, then closed."""
        self.tally.note("malformed", f"a malformed request was refused: {e}")
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # a response has begun: nothing more can be said on this connection
        response = Response.error(e.error_status_hint, f"{self.name}: malformed HTTP request ({e})")
        response.headers["connection"] = "close"
        try:
            await self._send(conn, writer, response, head)
        except h11.LocalProtocolError:
            return  # h11 will not frame an answer here either
        await self._linger(reader)

    @staticmethod
    async def _linger(reader: asyncio.StreamReader) -> None:
        """Read and drop what the client is still sending, briefly: closing on unread data would
        reset the connection before the client reads the answer."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(LINGER_S):
                while await reader.read(CHUNK):
                    pass

    def _max_body(self) -> int:
        return max_body(self._limits)

    def _idle_s(self) -> float | None:
        return self._limits.idle_connection_s or None

    async def _read_head(self, conn: h11.Connection, reader: asyncio.StreamReader, first: bool) -> h11.Request | None:
        """The next request's head, or None once the client is done. A keep-alive connection may
        wait ``idle_connection_s`` for its next request; once a request has begun (and on a new
        connection, from the start) its whole head must arrive within ``header_timeout_s``."""
        loop = asyncio.get_running_loop()
        header_s = self._limits.header_timeout_s or None
        begun = first or bool(conn.trailing_data[0])
        async with asyncio.timeout(header_s if begun else self._idle_s()) as deadline:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(CHUNK)
                    if data and not begun:
                        begun = True
                        deadline.reschedule(None if header_s is None else loop.time() + header_s)
                    conn.receive_data(data)  # b"" marks EOF
                    if not data and conn.their_state in (h11.IDLE, h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                        return None
                    continue
                if isinstance(event, h11.Request):
                    return event
                if isinstance(event, h11.ConnectionClosed | h11.PAUSED):
                    return None

    async def _read_body(self, conn: h11.Connection, reader: asyncio.StreamReader) -> bytes | None:
        """The body, or None if it went over the limit (nothing more of it is kept); a client
        silent for ``idle_connection_s`` within it is cut."""
        body = bytearray()
        limit, idle_s = self._max_body(), self._idle_s()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                async with asyncio.timeout(idle_s):
                    conn.receive_data(await reader.read(CHUNK))  # b"" marks EOF (h11 then says it was cut short)
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > limit:  # a chunked body, over the limit
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            elif isinstance(event, h11.ConnectionClosed | h11.PAUSED):
                raise ConnectionError("the client closed the connection within a request body")


def _request(head: h11.Request) -> Request:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers}
    method = head.method.decode("latin-1")
    path = head.target.decode("latin-1").split("?", 1)[0]
    if method == "HEAD":
        return Request("GET", path, headers, b"", headers_only=True)
    return Request(method, path, headers, b"")


# the answers the server and the in-process transport (inprocess.py) give alike


def max_body(limits: Limits) -> int:
    return int(limits.max_body_mib * 2**20)


def too_large(name: str, limits: Limits) -> Response:
    return Response.error(413, f"the request body is over {name}'s limit of {max_body(limits)} bytes (max_body_mib)")


def internal_error(name: str, e: Exception) -> Response:
    return Response.error(500, f"{name}: internal error: {type(e).__name__}: {e}")
