"""The user of a chat socket, resolved without Channels' one sync thread.

Channels' `AuthMiddleware` loads every handshake's user with `database_sync_to_async`, which under daphne
is one thread for the whole process: in a burst of connects they queue on it one after another, and a
client with no session cookie (a token, the published clients under Node) still pays the hop. Here a
handshake without a session cookie is anonymous at once (its session is empty: there is no user to
load), and one with a cookie loads its user on the web process's database threads (chat.wire.pool).
The user is the same as Channels' would be (`channels.auth.get_user`).
"""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddleware, get_user
from channels.sessions import CookieMiddleware, SessionMiddleware
from django.conf import settings
from django.contrib.auth.models import AnonymousUser

from .pool import web_db


class PooledAuthMiddleware(AuthMiddleware):
    """`channels.auth.AuthMiddleware`, with the user loaded as described above."""

    async def resolve_scope(self, scope: Any) -> None:
        if not scope["cookies"].get(settings.SESSION_COOKIE_NAME):
            scope["user"]._wrapped = AnonymousUser()
            return
        scope["user"]._wrapped = await web_db(_get_user)(scope)


# Channels' own loader, the function under its `database_sync_to_async` (asgiref keeps it as `.func`).
_get_user = get_user.func  # type: ignore[attr-defined]


def AuthMiddlewareStack(inner: Any) -> Any:  # noqa: N802 - channels' style
    """Cookies, session and user for the chat socket, as `channels.auth.AuthMiddlewareStack` gives them."""
    return CookieMiddleware(SessionMiddleware(PooledAuthMiddleware(inner)))
