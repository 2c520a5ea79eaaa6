"""Liveness: a worker process that dies is noticed by its lost database session, in about a second.

Each worker process holds one Postgres session of its own for its whole life, with a session-level
advisory lock keyed by a number drawn when the process starts (its liveness key). The fibers it claims
record that key (`Fiber.lease_session`). When the process dies for any reason its socket closes,
Postgres ends the session and the lock is free within milliseconds: a poll on every live worker
(`LIVENESS_POLL_MS`) and the recovery tick look for running fibers whose owner's lock is free, mark
them, and a poll at least `LIVENESS_CONFIRM_MS` later hands those still without their owner and
unrenewed since to the engine, exactly as an expired lease would
(`recovery.lease.fibers.fibers_take_orphaned`).

What the session cannot see is left to the lease, as before: a frozen process (SIGSTOP, a stuck
loop) still holds its session; a host that vanishes without closing its sockets holds it until
Postgres notices. Fencing guards every write either way, so a takeover can never double-write.

No false takeovers:
- a process under load, in a long pause or waiting on a slow provider keeps its session and its lock;
- a process whose session drops (a restart of Postgres, a cut connection) takes the same key back
  within a few hundredths of a second, renews its leases on every flush tick meanwhile (a renewal
  after the mark clears the suspicion), and records no key on the fibers it claims until then;
- after Postgres itself restarts, nobody's lock is held until every worker has reconnected, so the
  session detector waits `LEASE_TTL_S` after the server started before trusting a free lock.

Behind a pooler in transaction mode (PgBouncer) a session lock means nothing: point
THINK["LIVENESS_DATABASE"] at a direct connection, or turn THINK["LIVENESS_SESSIONS"] off and rely on
the lease alone (`manage.py check` says which is in force, think_recovery.I001 / W002).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
from collections.abc import Callable
from typing import Any

from recovery.conf import claims_per_tick, setting
from recovery.lease.fibers import fibers_take_orphaned
from recovery.observe import metrics
from recovery.process import dispatch

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.2
# Keys are positive and below 2**62, so that they fit Postgres's signed bigint advisory-lock key.
_KEY_RANGE = (1, 2**62)

_key: int = random.SystemRandom().randrange(*_KEY_RANGE)
_lock = threading.Lock()
_session: Any = None  # the concurrent.futures.Future of the session's coroutine
_poller: Any = None


def _always() -> bool:
    return True


# Whether this process takes part in the search for dead workers now (see start(): `judges`).
_judges: Callable[[], bool] = _always
held = threading.Event()  # set while this process's session holds its lock
_lost = threading.Event()  # set once the lock was held and then lost (until it is held again)


def key() -> int:
    """This process's liveness key (the same for its whole life, a new one after a fork)."""
    return _key


def session_key() -> int | None:
    """What a claim records as the fiber's lease session: the key while the lock is held, else None
    (such a fiber is detected by its lease alone)."""
    return _key if held.is_set() else None


def degraded() -> bool:
    """The session was lost and is not back: the process renews its leases on every flush tick."""
    return _lost.is_set() and not held.is_set()


def enabled() -> bool:
    return bool(setting("LIVENESS_SESSIONS"))


def start(*, judges: Callable[[], bool] | None = None) -> None:
    """Start this process's liveness session and its poll (once; again after a fork), unless
    THINK['LIVENESS_SESSIONS'] is off.

    `judges`, asked before each poll, says whether the process looks for dead workers then: a worker
    that does not consume the queue the recovery work goes to (one parked on a queue of its own, or
    serving other queues only) holds its session but takes nobody's fibers."""
    global _session, _poller, _judges
    if judges is not None:
        _judges = judges
    if not enabled():
        logger.info("liveness sessions are off: a dead worker is detected by its lease alone")
        return
    from recovery.process.runtime import get_loop

    with _lock:
        if _session is None or _session.done():
            _session = asyncio.run_coroutine_threadsafe(_hold(), get_loop())
        if float(setting("LIVENESS_POLL_MS")) > 0 and (_poller is None or _poller.done()):
            _poller = asyncio.run_coroutine_threadsafe(_poll(), get_loop())


def stop() -> None:
    """Close the session and stop the poll (tests; a worker's end with the process)."""
    global _session, _poller, _judges
    with _lock:
        running, _session, _poller, _judges = [_session, _poller], None, None, _always
    for future in running:
        if future is not None:
            future.cancel()


async def wait_held(timeout: float) -> bool:
    """Wait (briefly) for the lock, so that a turn claimed right after start-up records the key."""
    if held.is_set() or _session is None:
        return held.is_set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not held.is_set() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return held.is_set()


def _connection_params() -> dict[str, Any]:
    from recovery.lease.control import session_params

    return {**session_params(str(setting("LIVENESS_DATABASE"))), "application_name": f"think-liveness:{_key}"}


async def _hold() -> None:
    import psycopg

    while True:
        try:
            async with await psycopg.AsyncConnection.connect(**_connection_params(), autocommit=True) as conn:
                while not await _try_lock(conn):  # a poll's check holds it for an instant: try again
                    await asyncio.sleep(RECONNECT_DELAY_S)
                held.set()
                _lost.clear()
                logger.info("liveness session holds key %s", _key)
                # Nothing is ever sent on this session: waiting for a notification only ends when the
                # connection does (Postgres restarted, the connection was cut).
                async for _ in conn.notifies():
                    pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if held.is_set():
                logger.warning("liveness session lost (%s); reconnecting", exc)
        finally:
            if held.is_set():
                _lost.set()
            held.clear()
        await asyncio.sleep(RECONNECT_DELAY_S)


async def _try_lock(conn: Any) -> bool:
    cursor = await conn.execute("SELECT pg_try_advisory_lock(%s)", [_key])
    row = await cursor.fetchone()
    return bool(row and row[0])


# After a liveness session is seen to go, the poll looks at the fibers for this long: the first sighting
# comes once their lease is FRESH_LEASE stale, the confirmation LIVENESS_CONFIRM_MS later, each at a poll.
WATCH_AFTER_LOSS_S = 2.0


async def _poll() -> None:
    """Every LIVENESS_POLL_MS, list the liveness sessions (a look at pg_stat_activity, no table); when
    one has gone since the last look, and for WATCH_AFTER_LOSS_S after it, hand the fibers of dead
    processes to the engine. The fiber query runs only then (and once at start, for deaths before it):
    every lease renewal leaves a dead entry in the index of running fibers until vacuum (it changes an
    indexed column), so that scan grows with the turns' traffic, and run several times a second on
    every worker it cost Postgres a third more per streamed number (bench/concurrency.py)."""
    from recovery.process.runtime import db

    seen: set[str] | None = None
    watch_until = 0.0
    loop = asyncio.get_running_loop()
    first = await wait_held(5.0)  # the first look comes once the session is held: a new worker's first job
    while True:
        if not first:
            await asyncio.sleep(float(setting("LIVENESS_POLL_MS")) / 1000)
        first = False
        if not held.is_set():
            continue  # a process without its own session is in no position to judge others'
        if not _judges():
            seen = None  # when it judges again, it looks at the fibers once, as at start
            continue
        try:
            live = await db(live_sessions)
            if seen is None or seen - live:
                watch_until = loop.time() + WATCH_AFTER_LOSS_S
            seen = live
            if loop.time() > watch_until:
                continue
            taken = await db(take_orphaned)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the database is away: the next poll tries again
            logger.debug("liveness poll failed: %s", exc)
            continue
        if taken:
            logger.warning("liveness: %s fibers of dead workers handed to recovery", len(taken))


def live_sessions() -> set[str]:
    """The application names of the liveness sessions connected to this database now."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE 'think-liveness:%%'"
        )
        return {row[0] for row in cursor.fetchall()}


def take_orphaned(limit: int | None = None) -> list[Any]:
    """Take over the fibers of processes whose session is gone, and send each to the engine: at most
    `limit` (THINK["RECOVERY_CLAIMS_PER_TICK"] by default) per poll, the rest at the next ones."""
    from django.db import transaction

    limit = claims_per_tick() if limit is None else limit
    with transaction.atomic():
        taken = fibers_take_orphaned(limit=limit)
    for fiber_id in taken:
        dispatch.recover_later(str(fiber_id))
    metrics.session_losses_observed(len(taken))
    return taken


def _forget_after_fork() -> None:
    global _key, _lock, _session, _poller, _judges
    _key = random.SystemRandom().randrange(*_KEY_RANGE)
    _lock, _session, _poller, _judges = threading.Lock(), None, None, _always
    held.clear()
    _lost.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
