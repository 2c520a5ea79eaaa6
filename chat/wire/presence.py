"""Which WebSocket connections are open, across web processes (Django's cache; Redis in production).

Only used to tell whether the connection that owns a tool continuation is still there (while it is,
another connection's probe hears `continuation-owned`: docs/protocol.md). With a per-process cache it
only sees its own process's connections, which errs towards letting the other connection resume.
"""

from __future__ import annotations

from django.core.cache import cache

PRESENCE_TTL_S = 24 * 3600


def _key(channel_name: str) -> str:
    return f"think:presence:{channel_name}"


async def connection_join(channel_name: str) -> None:
    await cache.aset(_key(channel_name), 1, timeout=PRESENCE_TTL_S)


async def connection_leave(channel_name: str) -> None:
    await cache.adelete(_key(channel_name))


def connection_present(channel_name: str) -> bool:
    return bool(cache.get(_key(channel_name)))
