"""ASGI middleware rejecting oversized request bodies before they are read whole.

A declared ``Content-Length`` over the limit is answered 413 at once; a chunked body is
counted as it streams and cut off with 413 when it passes the limit. The answer has the
API's error shape, or OpenAI's on the OpenAI endpoints (``openai_paths``), and closes the
connection (``connection: close``): the rest of the body is not kept, and a kept
connection would have had to read and discard it all before its next request. Under
``kvevents serve`` the close lingers (:mod:`kvevents.api.conn_guard`): the client,
still uploading, reads the 413 instead of a reset connection.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvevents.api.http_head import error_bytes


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, openai_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.openai_paths = openai_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await self._reject(scope, send)
                    return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self._reject(scope, send)

    async def _reject(self, scope: Scope, send: Send) -> None:
        body = error_bytes(413, f"request body larger than {self.max_bytes} bytes",
                           openai=scope.get("path") in self.openai_paths)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
