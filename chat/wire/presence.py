"""Which WebSocket connections are open, across web processes (the shared cache; Redis in production).

Only used to tell whether the connection that owns a tool continuation is still there (while it is,
another connection's probe hears `continuation-owned`: docs/protocol.md). With a per-process cache it
only sees its own process's connections, which errs towards letting the other connection resume.
"""

from __future__ import annotations

from asgiref.sync import sync_to_async

from ..caching import shared_cache

PRESENCE_TTL_S = 24 * 3600


def _key(channel_name: str) -> str:
    return f"think:presence:{channel_name}"


def _join(channel_name: str) -> None:
    shared_cache().set(_key(channel_name), 1, timeout=PRESENCE_TTL_S)


def _leave(channel_name: str) -> None:
    shared_cache().delete(_key(channel_name))


# Not Django's async cache methods: they hop to the process's one sync thread, shared by every socket.
async def connection_join(channel_name: str) -> None:
    await sync_to_async(_join, thread_sensitive=False)(channel_name)


async def connection_leave(channel_name: str) -> None:
    await sync_to_async(_leave, thread_sensitive=False)(channel_name)


def connection_present(channel_name: str) -> bool:
    return bool(shared_cache().get(_key(channel_name)))
