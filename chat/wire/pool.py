"""The web process's database threads: every database call of the chat socket and the HTTP chat wire runs
on a pool of THINK["WEB_DB_THREADS"] threads, each with a connection of its own (kept CONN_MAX_AGE).

Not Channels' default (`database_sync_to_async` with thread_sensitive=True): under daphne that is one
thread for every consumer of the process, so a burst of chat requests was accepted one after the other,
each waiting on Postgres in turn (bench/overload.py: 500 sends, the last accepted 10-20 s after it came).
Here they overlap: a request's lock wait or round trip holds one thread, not the process. Nor the loop's
default executor: it also runs the redis and file calls, and sizing it would size them too.

Concurrent accepts of one conversation stay in order where it matters: `turn_accept` locks the
conversation's row first. A streaming HTTP answer holds no thread while it waits (chat.wire.http).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from ..conf import think_setting

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            threads = int(think_setting("WEB_DB_THREADS"))
            _executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="think-web-db")
        return _executor


def web_db(fn: Callable[P, T]) -> Callable[P, Awaitable[T]]:
    """`fn` on the web process's database threads, with that thread's connection."""
    return sync_to_async(_fresh(fn), thread_sensitive=False, executor=_pool())


def _fresh(fn: Callable[P, T]) -> Callable[P, T]:
    """`fn` between two checks of the thread's connection: closed when older than CONN_MAX_AGE, or
    broken (CONN_HEALTH_CHECKS), as Django does around a request. Channels' `database_sync_to_async`
    does the same, but its testing communicator turns its checks off; these run in tests too, so a
    connection a test ended (a Postgres restart, say) is never handed to the next call."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return call


def web_db_threads() -> int:
    """How many threads the pool has (at most THINK["WEB_DB_THREADS"], read when it was first used)."""
    return _pool()._max_workers
