"""Origin checks for the chat WebSocket (the rule itself: chat.origins)."""

from __future__ import annotations

from typing import Any

from channels.security.websocket import WebsocketDenier

from ..origins import origin_allowed


class BrowserOriginValidator:
    """Refuse a browser's handshake from another origin (403, before the consumer runs); let clients that
    send no Origin at all through to the access policy.

    The Origin check exists to stop another site's page from using a visitor's cookies (CSWSH); browsers
    always send Origin, and it must be the site's own (scheme, host and port) or a trusted one
    (chat.origins). Programmatic clients (the published `agents` client under Node, server-side code)
    send none, and refusing them would lock out every non-browser client.
    """

    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
        if scope["type"] != "websocket":
            raise ValueError("BrowserOriginValidator guards WebSocket connections only")
        origins = [value for name, value in scope.get("headers") or () if bytes(name).lower() == b"origin"]
        if all(origin_allowed(bytes(value).decode("latin-1"), scope) for value in origins):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)


def AllowedHostsBrowserOriginValidator(application: Any) -> BrowserOriginValidator:  # noqa: N802 - channels' style
    """The site's WebSocket guard: browsers only from its own origin or THINK["TRUSTED_ORIGINS"]."""
    return BrowserOriginValidator(application)
