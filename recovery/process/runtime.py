"""One long-lived asyncio event loop per worker process.

Turns spend nearly all their time waiting on the provider, so they run as coroutines on a single loop
per process (one Redis pool, one set of HTTP clients) whichever Celery pool executes the task: the task
thread only submits the coroutine and waits. Database calls hop to a small thread pool, so a process
holds a handful of Postgres connections however many turns it runs.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from django.db import connection
from django.db.utils import InterfaceError, OperationalError

from recovery.conf import setting

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

# What a lost database (a restart, a failover, a cut connection) looks like to a caller.
DATABASE_LOST = (InterfaceError, OperationalError)

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_executor: ThreadPoolExecutor | None = None


async def maybe_await(value: T | Awaitable[T]) -> T:
    """The value a hook returned, awaited when it is awaitable: hooks may be sync or `async def`."""
    if inspect.isawaitable(value):
        return await value
    return value


def _start() -> asyncio.AbstractEventLoop:
    global _loop, _executor
    loop = asyncio.new_event_loop()
    # Database calls get threads of their own: litellm runs parts of every call in the loop's default
    # executor, and sharing it made chunk flushes queue behind model calls (measured, see benchmarks).
    threads = int(setting("DB_THREADS"))
    _executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="think-db")
    loop.set_default_executor(ThreadPoolExecutor(max_workers=32, thread_name_prefix="think-io"))
    thread = threading.Thread(target=loop.run_forever, name="think-loop", daemon=True)
    thread.start()
    _loop = loop
    return loop


def get_loop() -> asyncio.AbstractEventLoop:
    with _lock:
        return _loop if _loop is not None and not _loop.is_closed() else _start()


def _forget_after_fork() -> None:
    # A forked child inherits the parent's loop object but not its thread: start afresh on first use.
    global _loop, _executor, _lock
    _loop, _executor, _lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def owns_running_loop() -> bool:
    """True on the process loop (a worker's turns run there for the life of the process)."""
    try:
        return asyncio.get_running_loop() is _loop
    except RuntimeError:
        return False


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run a coroutine on the process loop from a synchronous caller (a Celery task thread)."""
    future = asyncio.run_coroutine_threadsafe(coro, get_loop())
    try:
        return future.result(timeout)
    except BaseException:
        future.cancel()
        raise


def _with_reconnect(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Call fn on this DB thread; a connection broken by a Postgres restart is reopened once."""
    try:
        return fn(*args, **kwargs)
    except DATABASE_LOST:
        if connection.in_atomic_block:
            raise
        logger.warning("database connection failed; reconnecting once", exc_info=True)
        connection.close()
        return fn(*args, **kwargs)


async def db(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a synchronous database function on the DB thread pool (the loop's default one elsewhere)."""
    loop = asyncio.get_running_loop()
    executor = _executor if loop is _loop else None
    return await loop.run_in_executor(executor, functools.partial(_with_reconnect, fn, *args, **kwargs))


def dump_tasks() -> None:
    """Log the stack of every coroutine on the process loop (SIGUSR1 in a worker; see chat.tasks)."""
    loop = _loop
    if loop is None or loop.is_closed():
        return

    def dump() -> None:
        import io

        for task in asyncio.all_tasks(loop):
            out = io.StringIO()
            task.print_stack(file=out)
            logger.warning("task %s:\n%s", task.get_name(), out.getvalue())

    loop.call_soon_threadsafe(dump)
