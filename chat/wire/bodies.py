"""A bound on HTTP request bodies, enforced before Django reads them.

Django's ASGI handler reads a whole request body (into memory, then a temporary file) before any view
runs, so a view's own size check comes after the bytes were taken. `BodyLimit` wraps the HTTP
application: a body declared (Content-Length) or found, as its chunks arrive, to be larger than the
largest the chat app takes is refused with 413 and not read further. The largest is a chat request
(THINK["MAX_FRAME_BYTES"]) or an upload (THINK["MAX_FILE_BYTES"] and its multipart envelope),
whichever is larger; thinkproject/asgi.py wraps the demo site in it, and a host site's asgi.py may too.
"""

from __future__ import annotations

from typing import Any

from ..conf import think_setting
from .files import upload_limit


def body_limit() -> int:
    return max(int(think_setting("MAX_FRAME_BYTES")), upload_limit())


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
        if scope["type"] != "http":
            return await self.application(scope, receive, send)
        most = body_limit()
        declared = [bytes(v) for k, v in scope.get("headers") or () if bytes(k).lower() == b"content-length"]
        if declared and (not declared[0].isdigit() or int(declared[0]) > most):
            return await _refuse(send, most)
        received = 0

        async def bounded() -> Any:
            nonlocal received
            message = await receive()
            if message.get("type") == "http.request":
                received += len(message.get("body") or b"")
                if received > most:
                    raise _TooLarge
            return message

        try:
            return await self.application(scope, bounded, send)
        except _TooLarge:
            return await _refuse(send, most)


async def _refuse(send: Any, most: int) -> None:
    body = f"Request body refused: larger than the {most} bytes this site takes".encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
