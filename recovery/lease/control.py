"""Signals to the process that runs a fiber: a cancel reaches its worker at once.

Every worker process keeps one Postgres session of its own that LISTENs on one channel (started with
the worker, `chat.tasks`).
`fiber_request_cancel` NOTIFYs that channel in the transaction that sets the fiber's cancel flag, so
the signal leaves exactly when the flag commits, and the process that holds the fiber stops the turn
within a millisecond or two instead of at its next flush or heartbeat. (A turn run in a process
without the session, such as a turn run in a web process, hears of it at its next heartbeat.)

The flag stays the durable copy. A process without its listening session (the connection dropped, a
pooler in transaction mode where LISTEN does not work) hears of the cancel at its next flush or
heartbeat instead; and the fenced segment write refuses every chunk from the moment the cancel
committed (`recovery.stream.buffer`), so in no case is anything stored or sent after it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

CHANNEL = "think_cancel"
RECONNECT_DELAY_S = 1.0

# fiber id -> a callback that stops its turn (called on the listener's loop; it must be thread-safe)
_watchers: dict[str, Callable[[], object]] = {}
_lock = threading.Lock()
_listener: Any = None  # the concurrent.futures.Future of the listening coroutine
listening = threading.Event()  # set while the session is LISTENing (tests and health read it)


def notify_cancel(cursor: Any, fiber_id: Any) -> None:
    """Queue the cancel signal of a fiber; Postgres sends it when the caller's transaction commits."""
    cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, str(fiber_id)])


def watch(fiber_id: Any, callback: Callable[[], object]) -> None:
    """Call `callback` when a cancel of `fiber_id` is signalled (until `unwatch`)."""
    _watchers[str(fiber_id)] = callback


def unwatch(fiber_id: Any) -> None:
    _watchers.pop(str(fiber_id), None)


def start() -> None:
    """Start this process's listening session (once; again after a fork), unless THINK['CANCEL_SIGNALS']
    is off."""
    global _listener
    from recovery.conf import setting

    if not setting("CANCEL_SIGNALS"):
        logger.info("cancel signals are off: turns hear of a cancel at their next flush or heartbeat")
        return
    with _lock:
        if _listener is not None and not _listener.done():
            return
        from recovery.process.runtime import get_loop

        _listener = asyncio.run_coroutine_threadsafe(_listen(), get_loop())


def stop() -> None:
    """Close this process's listening session (tests; a worker's ends with the process)."""
    global _listener
    with _lock:
        listener, _listener = _listener, None
    if listener is not None:
        listener.cancel()


def session_params(alias: str = "default") -> dict[str, Any]:
    """psycopg connect arguments for a dedicated session of a process (the cancel listener here, the
    liveness session in recovery.lease.liveness), from a DATABASES entry."""
    from django.db import connections

    params = connections[alias].get_connection_params()
    # Django's own adapters and cursor class are for its connections, not this one.
    return {k: v for k, v in params.items() if k not in ("cursor_factory", "context", "prepare_threshold")}


async def _listen() -> None:
    import psycopg

    while True:
        try:
            async with await psycopg.AsyncConnection.connect(**session_params(), autocommit=True) as conn:
                await conn.execute(f"LISTEN {CHANNEL}")
                listening.set()
                async for notice in conn.notifies():
                    callback = _watchers.get(notice.payload)
                    if callback is not None:
                        callback()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Postgres restarted, or unreachable: flags and fencing still hold
            logger.warning("cancel listener lost its session (%s); reconnecting", exc)
        finally:
            listening.clear()
        await asyncio.sleep(RECONNECT_DELAY_S)


def _forget_after_fork() -> None:
    global _listener, _lock
    _listener, _lock = None, threading.Lock()
    _watchers.clear()
    listening.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
