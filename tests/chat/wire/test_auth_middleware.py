"""chat.wire.auth: the socket's user, as Channels' AuthMiddlewareStack resolves it, without its one
sync thread."""

from __future__ import annotations

import threading
from importlib import import_module
from typing import Any
from unittest import mock

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model

from chat.wire import auth
from chat.wire.auth import AuthMiddlewareStack

pytestmark = pytest.mark.django_db(transaction=True)


def logged_in_session(user: Any) -> str:
    store = import_module(settings.SESSION_ENGINE).SessionStore()
    store[SESSION_KEY] = str(user.pk)
    store[BACKEND_SESSION_KEY] = settings.AUTHENTICATION_BACKENDS[0]
    store[HASH_SESSION_KEY] = user.get_session_auth_hash()
    store.save()
    return str(store.session_key)


async def resolved(cookie: str | None) -> dict[str, Any]:
    """The user the stack gives the application, and the thread that loaded it."""
    seen: dict[str, Any] = {}
    loader = auth._get_user

    def loading(scope: Any) -> Any:
        seen["thread"] = threading.current_thread().name
        return loader(scope)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["user"] = scope["user"]._wrapped

    headers = [(b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode())] if cookie else []
    with mock.patch.object(auth, "_get_user", side_effect=loading):
        await AuthMiddlewareStack(app)({"type": "websocket", "headers": headers}, None, None)
    return seen


async def test_a_session_cookies_user_is_loaded_on_the_web_database_threads() -> None:
    user = await sync_to_async(get_user_model().objects.create_user)("pooled-auth")
    seen = await resolved(await sync_to_async(logged_in_session)(user))
    assert seen["user"].pk == user.pk and seen["user"].is_authenticated
    assert seen["thread"].startswith("think-web-db"), "not Channels' one sync thread"


async def test_a_handshake_without_a_session_cookie_is_anonymous_without_a_load() -> None:
    seen = await resolved(None)
    assert not seen["user"].is_authenticated
    assert "thread" not in seen, "nothing to load: no thread is asked"


async def test_a_cookie_of_no_session_is_anonymous() -> None:
    seen = await resolved("not-a-session-key")
    assert not seen["user"].is_authenticated and seen["thread"].startswith("think-web-db")
