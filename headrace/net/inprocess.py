"""An ``httpx`` transport that hands each request to a handler of ``http.py`` in this process.

For a client that runs on the same event loop as the server it calls (an agent written as an
async function, calling the agents' endpoint): the request goes to the same ``admit`` hook and
handler as one that came over the socket, and their ``Response`` comes back as the client's, but
no connection is opened and nothing is written, read or parsed as HTTP on either side. Measured
(``benchmarks/agent_overhead.py``), that is most of what a loopback round trip costs both sides
in CPU; the client above the transport (the ``openai`` SDK, httpx's request and response
objects) is unchanged.

What the wire would do is kept where a client could see the difference: a body over the
server's limit is answered 413, a handler's bug 500 with a body, ``DROP`` is a dropped
connection (``httpx.RemoteProtocolError``), and the client's read timeout bounds the wait for
the answer (``httpx.ReadTimeout``). Cancelling the client's call cancels the handler, as closing
the connection would.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from .http import DROP, Admit, Handler, Request, Response, internal_error, max_body, too_large
from .limits import Limits


class InProcessTransport(httpx.AsyncBaseTransport):
    def __init__(self, handler: Handler, limits: Limits, name: str, admit: Admit | None = None):
        self.handler, self.limits, self.name, self.admit = handler, limits, name, admit

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._answer(request)
        headers = [
            ("content-type", response.content_type),
            ("content-length", str(len(response.body))),
            *response.headers.items(),
        ]
        # a transport's answer is a stream (read by the client when it wants the body), as httpx's
        # own transports give it: content= would read it here, and re-derive the headers above
        return httpx.Response(response.status, headers=headers, stream=httpx.ByteStream(response.body), request=request)

    async def _answer(self, request: httpx.Request) -> Response:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers.raw}
        head = Request(request.method, request.url.path, headers, b"")
        body = await request.aread()
        if len(body) > max_body(self.limits):
            return too_large(self.name, self.limits)
        if self.admit is not None:
            try:
                refusal = self.admit(head)
            except Exception as e:  # noqa: BLE001 - as over the wire: a hook's bug is answered 500
                return internal_error(self.name, e)
            if refusal is not None:
                return refusal
        head.body = body
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        try:
            async with asyncio.timeout(timeouts.get("read")):
                result = await self.handler(head)
        except TimeoutError:
            said = f"{self.name} did not answer within the client's read timeout"
            raise httpx.ReadTimeout(said, request=request) from None
        except Exception as e:  # noqa: BLE001 - as over the wire: a handler's bug is answered 500
            return internal_error(self.name, e)
        if result is DROP:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        assert isinstance(result, Response)
        return result
