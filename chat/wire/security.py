"""Origin checks for the chat WebSocket."""

from __future__ import annotations

from typing import Any
from urllib.parse import ParseResult

from channels.security.websocket import OriginValidator
from django.conf import settings


class BrowserOriginValidator(OriginValidator):
    """Reject cross-site browser connections, accept clients that send no Origin at all.

    The Origin check exists to stop another site's page from using a visitor's cookies (CSWSH); browsers
    always send Origin. Programmatic clients (the published `agents` client under Node, server-side
    code) send none, and refusing them would lock out every non-browser client.
    """

    def valid_origin(self, parsed_origin: ParseResult | None) -> bool:
        if parsed_origin is None:
            return True
        return bool(super().valid_origin(parsed_origin))


def AllowedHostsBrowserOriginValidator(application: Any) -> BrowserOriginValidator:  # noqa: N802 - channels' style
    """Like channels' AllowedHostsOriginValidator, but lets Origin-less (non-browser) clients in."""
    allowed = list(settings.ALLOWED_HOSTS)
    if settings.DEBUG and not allowed:
        allowed = ["localhost", "127.0.0.1", "[::1]"]
    return BrowserOriginValidator(application, allowed)
