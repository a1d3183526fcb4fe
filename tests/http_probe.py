"""Raw HTTP/1.1 on a socket, for requests no well-behaved client would send (tests/test_servers_*.py)."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import Any

AUTH = b"authorization: Bearer test-token-123\r\n"  # serve_support.TOKEN


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Conn:
    """A client connection that keeps what it read past one response for the next."""

    def __init__(self, port: int, timeout_s: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.buffer = b""

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def _more(self) -> bool:
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            return False
        self.buffer += chunk
        return bool(chunk)


def connect(port: int, timeout_s: float = 10.0) -> Conn:
    return Conn(port, timeout_s)


def send(conn: Conn, *parts: bytes, pause_s: float = 0.0, half_close: bool = False) -> None:
    """Each part in its own write (``pause_s`` apart); ``half_close``: then no more (EOF to the server)."""
    try:
        for i, part in enumerate(parts):
            if i and pause_s:
                time.sleep(pause_s)
            conn.sock.sendall(part)
        if half_close:
            conn.sock.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before all of it was sent: the answer is still there to read


def read_reply(conn: Conn, head: bool = False) -> Reply | None:
    """The next response on ``conn`` (a HEAD's: headers only), or None if the server closed it
    without answering. A server that says nothing raises ``TimeoutError`` (the socket's timeout)."""
    while b"\r\n\r\n" not in conn.buffer:
        if not conn._more():
            return None
    top, conn.buffer = conn.buffer.split(b"\r\n\r\n", 1)
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = 0 if head else int(headers.get("content-length", "0"))
    while len(conn.buffer) < length and conn._more():
        pass
    body, conn.buffer = conn.buffer[:length], conn.buffer[length:]
    return Reply(int(lines[0].split()[1]), headers, body)


def exchange(port: int, *parts: bytes, head: bool = False, **how: Any) -> Reply | None:
    with connect(port) as conn:
        send(conn, *parts, **how)
        return read_reply(conn, head)


def closed_within(conn: Conn, seconds: float) -> float | None:
    """Seconds until the server closed ``conn`` (reading whatever it sends), None if still open then."""
    started = time.monotonic()
    conn.sock.settimeout(0.2)
    while time.monotonic() - started < seconds:
        try:
            if not conn._more():
                return time.monotonic() - started
        except TimeoutError:
            continue
    return None


def post(path: str, body: bytes, *extra: bytes, auth: bool = True) -> bytes:
    headers = b"".join(extra) + (AUTH if auth else b"")
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n".encode()
        + headers
        + b"\r\n"
        + body
    )


def get(path: str, method: str = "GET", auth: bool = False) -> bytes:
    return f"{method} {path} HTTP/1.1\r\nhost: x\r\n".encode() + (AUTH if auth else b"") + b"\r\n"


DEEP_JSON = b"[" * 100_000 + b"]" * 100_000

# (what is wrong, the bytes, how to send them, the status h11's hint gives) for every kind of
# request h11 refuses; the status is what HTTP allows in answer (501: a transfer coding it lacks)
MALFORMED: list[tuple[str, list[bytes], dict[str, Any], int]] = [
    ("a negative Content-Length", [b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n"], {}, 400),
    ("a Content-Length that is not a number", [b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 1e3\r\n\r\n"], {}, 400),
    (
        "two Content-Lengths that disagree",
        [b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!"],
        {},
        400,
    ),
    (
        "a body cut short of its Content-Length",
        [b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n" + AUTH + b"\r\n{}"],
        {"half_close": True},
        400,
    ),
    ("no Host header", [b"GET /healthz HTTP/1.1\r\n\r\n"], {}, 400),
    ("a header line without a colon", [b"GET /healthz HTTP/1.1\r\nhost: x\r\nbroken\r\n\r\n"], {}, 400),
    ("a request line that is not HTTP", [b"\x00\x01\x02 nonsense\r\n\r\n"], {}, 400),
    (
        "a chunk size that is not hex",
        [b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n" + AUTH + b"\r\nzz\r\nhello\r\n0\r\n\r\n"],
        {},
        400,
    ),
    (
        "a negative chunk size",
        [b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n" + AUTH + b"\r\n-5\r\nhello\r\n0\r\n\r\n"],
        {},
        400,
    ),
    ("an unknown transfer coding", [b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n"], {}, 501),
    (
        "a head over 64 KiB",
        [b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000, b"a" * 10 + b"\r\n\r\n"],
        {"pause_s": 0.3},
        431,
    ),
]
