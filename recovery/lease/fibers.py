"""Fibers: claim, heartbeat and finish a turn under a lease with a fencing number.

A fiber is claimed by exactly one worker at a time. Claiming bumps the fencing number, and every write
the worker makes afterwards (segments, heartbeats, the final message) is conditional on that number, so a
second delivery of the task or a worker that wakes up after its lease moved on cannot write anything.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce, Now, NullIf

from recovery.conf import setting
from recovery.exceptions import LeaseLost
from recovery.lease.control import notify_cancel
from recovery.models import Fiber, owner_model
from recovery.process.rows import row_insert

logger = logging.getLogger(__name__)

# A fiber's snapshot is JSON the owning app writes when it creates the fiber. While the fiber runs this
# layer patches three slots of it in SQL, each in a statement of its own, so no write clobbers another.
STASH_SLOT = "user"  # what the running work keeps for its recovery (fiber_stash)
CURSOR_SLOT = "reattach"  # the provider cursor the stream's segment writes record (recovery.stream.buffer)
TRACE_SLOT = "trace"  # the trace context of the fiber's run (fiber_trace_record, recovery.observe.tracing)

# A fiber's id: its primary key (Fiber.id, a UUID), or that UUID as text, the form task arguments and
# the owning app's records carry. The ORM and the raw statements here take either.
FiberId = uuid.UUID | str


@dataclass(frozen=True)
class Claim:
    fiber_id: uuid.UUID
    fencing: int
    conversation_id: int
    request_id: str
    kind: str
    snapshot: dict[str, Any] | None
    # The conversation row as the claim found it (locked): what the turn needs of it to start.
    conversation: dict[str, Any] = field(default_factory=dict)


def worker_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def lease_ttl() -> timedelta:
    return timedelta(seconds=float(setting("LEASE_TTL_S")))


def fiber_create(
    *, conversation_id: int, request_id: str, kind: str, snapshot: dict[str, Any] | None
) -> Fiber:
    """A new pending fiber, inserted as `Fiber.objects.create` would (recovery.process.rows: on every accepted
    turn the ORM's compile cost more than the insert, issue 37)."""
    fiber = Fiber(conversation_id=conversation_id, request_id=request_id, kind=kind, snapshot=snapshot)
    row_insert(fiber)
    return fiber


_CLAIM_LOCK = """
SELECT c.id{columns}
FROM {fiber} AS f JOIN {conversation} AS c ON c.id = f.conversation_id
WHERE f.id = %s AND f.status = 'pending'
FOR UPDATE OF c
"""
# After the lock: a statement of its own, so it sees every claim committed while it waited.
_CLAIM = """
UPDATE {fiber} AS f SET status = 'running', fencing = f.fencing + 1, lease_owner = %(owner)s,
    lease_session = %(session)s, lease_expires_at = now() + %(ttl)s, heartbeat_at = now(), started_at = now()
WHERE f.id = %(fiber)s AND f.status = 'pending' AND NOT EXISTS (
    SELECT 1 FROM {fiber} AS o
    WHERE o.conversation_id = f.conversation_id AND o.id <> f.id
        AND (o.status = 'running' OR (o.status = 'pending' AND o.created_at < f.created_at))
)
RETURNING f.fencing, f.conversation_id, f.request_id, f.kind, f.snapshot
"""


def fiber_claim(
    *, fiber_id: FiberId, owner: str, fields: Sequence[str] = (), session: int | None = None
) -> Claim | None:
    """Take the lease of a pending fiber; None when it is not pending or its conversation is busy.

    Claims are serialised per conversation by locking the conversation row, so only one turn of a
    conversation runs at a time across all workers, and turns start in the order they were accepted.
    `fields` are the owner row's fields the work needs to start, read under that lock (Claim.conversation).
    `session`: the claiming process's liveness key while it holds its lock (recovery.lease.liveness).
    """
    model = owner_model()
    owner_fields = [model._meta.get_field(name) for name in fields]
    tables = {"fiber": Fiber._meta.db_table, "conversation": model._meta.db_table}
    columns = "".join(
        f", c.{connection.ops.quote_name(str(getattr(f, 'column', f.name)))}" for f in owner_fields
    )
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_CLAIM_LOCK.format(columns=columns, **tables), [fiber_id])
        locked = cursor.fetchone()
        if locked is None:
            return None
        params: dict[str, Any] = {"fiber": fiber_id, "owner": owner, "ttl": lease_ttl(), "session": session}
        cursor.execute(_CLAIM.format(**tables), params)
        row = cursor.fetchone()
    if row is None:
        return None
    fencing, conversation_id, request_id, kind, snapshot = row
    conversation = {"id": locked[0]}
    for owner_field, raw in zip(owner_fields, locked[1:], strict=True):
        # A raw cursor leaves some decoding (jsonb) to the model field, as a queryset would do it.
        from_db = getattr(owner_field, "from_db_value", None)
        conversation[owner_field.name] = from_db(raw, None, connection) if from_db is not None else raw
    claimed = uuid.UUID(str(fiber_id))
    return Claim(claimed, fencing, conversation_id, request_id, kind, _json(snapshot), conversation)


def _json(value: Any) -> Any:
    """A jsonb column read with a raw cursor (Django leaves its decoding to the model field)."""
    return json.loads(value) if isinstance(value, str | bytes) else value


@dataclass(frozen=True)
class Heartbeat:
    alive: bool
    cancel_requested: bool = False


def fiber_heartbeat(*, fiber_id: FiberId, fencing: int) -> Heartbeat:
    """Renew the lease; tells whether it is still ours and whether a cancel was asked for."""
    fiber = Fiber.objects.filter(pk=fiber_id, fencing=fencing, status=Fiber.Status.RUNNING)
    if not fiber.update(lease_expires_at=Now() + lease_ttl(), heartbeat_at=Now()):
        return Heartbeat(alive=False)
    cancel = Fiber.objects.values_list("cancel_requested", flat=True).get(pk=fiber_id)
    return Heartbeat(alive=True, cancel_requested=cancel)


def fiber_finish(*, fiber_id: FiberId, fencing: int, status: str, error: str = "") -> None:
    """Mark a fiber finished; raises LeaseLost if it is no longer ours. Call inside the final transaction."""
    updated = Fiber.objects.filter(pk=fiber_id, fencing=fencing, status=Fiber.Status.RUNNING).update(
        status=status, error=error, finished_at=Now(), lease_expires_at=None, lease_owner=""
    )
    if not updated:
        raise LeaseLost(f"fiber {fiber_id} fencing {fencing}")


_FIBER_FINISH = """
UPDATE {fiber} SET status = %(status)s, error = %(error)s, finished_at = now(), lease_expires_at = NULL,
    lease_owner = ''
WHERE id = %(fiber)s AND fencing = %(fencing)s AND status = 'running'
RETURNING request_id, snapshot
"""


def fiber_finish_on(
    cursor: Any, *, fiber_id: FiberId, fencing: int, status: str, error: str = ""
) -> tuple[str, Any]:
    """fiber_finish as one plain statement on the caller's cursor (inside its transaction, among its
    own statements); the fiber's request id and snapshot. Raises LeaseLost if it is no longer ours."""
    params = {"status": status, "error": error, "fiber": fiber_id, "fencing": fencing}
    cursor.execute(_FIBER_FINISH.format(fiber=Fiber._meta.db_table), params)
    finished = cursor.fetchone()
    if finished is None:
        raise LeaseLost(f"fiber {fiber_id} fencing {fencing}")
    return finished[0], _json(finished[1])


def fibers_supersede_pending(*, conversation_id: int) -> tuple[str, ...]:
    """Cancel the fibers waiting in a conversation's queue (a newer request replaces them); their
    request ids."""
    waiting = Fiber.objects.filter(conversation_id=conversation_id, status=Fiber.Status.PENDING)
    superseded = tuple(waiting.values_list("request_id", flat=True))
    waiting.update(status=Fiber.Status.CANCELLED, finished_at=Now(), fencing=F("fencing") + 1)
    return superseded


def fiber_request_cancel(*, conversation_id: int, request_id: str) -> bool:
    """Ask the fiber of a request to stop; a pending one is cancelled at once.

    A running one gets the flag, and its worker the signal (`recovery.lease.control`) when it commits.
    """

    fibers = Fiber.objects.filter(conversation_id=conversation_id, request_id=request_id)
    with transaction.atomic():
        fibers.filter(status=Fiber.Status.PENDING).update(
            status=Fiber.Status.CANCELLED, finished_at=Now(), fencing=F("fencing") + 1
        )
        running = list(fibers.filter(status=Fiber.Status.RUNNING).values_list("pk", flat=True))
        asked = Fiber.objects.filter(pk__in=running, status=Fiber.Status.RUNNING)
        if not running or not asked.update(cancel_requested=True):
            return False
        with connection.cursor() as cursor:
            for fiber_id in running:
                notify_cancel(cursor, fiber_id)
    return True


def conversation_busy(conversation_id: int) -> bool:
    """A turn of the conversation is queued or running (an active fiber holds it; an interrupted one
    is the engine's, and its continuation is queued once scheduled): the one answer to "is the
    conversation busy?"."""
    return Fiber.objects.filter(conversation_id=conversation_id).active().exists()


def fibers_fence_out(*, conversation_id: int) -> int:
    """Cancel every active fiber of a conversation and fence out their workers (used by clear)."""
    return (
        Fiber.objects.filter(conversation_id=conversation_id)
        .active()
        .update(
            status=Fiber.Status.CANCELLED, finished_at=Now(), fencing=F("fencing") + 1, lease_expires_at=None
        )
    )


@dataclass(frozen=True)
class StoppedFiber:
    """A fiber a stop cancelled, as it was: what its owner must settle (a stream left open by a running
    or interrupted one; a request a queued one never answered)."""

    fiber_id: FiberId
    request_id: str
    status: str  # before the stop: pending, running or interrupted
    snapshot: Any


def fibers_stop(*, conversation_id: int) -> list[StoppedFiber]:
    """Cancel every unfinished fiber of an owner (queued, running, or the engine's after an
    interruption) and fence out whoever holds them; the running ones' workers get the cancel signal
    when the caller's transaction commits. Call with the owner row locked, inside that transaction.

    Once this commits nothing of them is stored (their segments and finish are fenced), the engine
    loads none of them, and the conversation is free for new work."""
    stopping = list(
        Fiber.objects.select_for_update()
        .filter(
            conversation_id=conversation_id,
            status__in=[Fiber.Status.PENDING, Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED],
        )
        .values_list("pk", "request_id", "status", "snapshot")
    )
    Fiber.objects.filter(pk__in=[row[0] for row in stopping]).update(
        status=Fiber.Status.CANCELLED,
        cancel_requested=True,
        finished_at=Now(),
        fencing=F("fencing") + 1,
        lease_expires_at=None,
        lease_owner="",
    )
    running = [row[0] for row in stopping if row[2] == Fiber.Status.RUNNING]
    if running:
        with connection.cursor() as cursor:
            for fiber_id in running:
                notify_cancel(cursor, fiber_id)
    return [
        StoppedFiber(pk, request_id, status, _json(snapshot)) for pk, request_id, status, snapshot in stopping
    ]


def next_pending_fiber(*, conversation_id: int) -> Any | None:
    """The fiber that should run next in a conversation, if none is running."""
    fibers = Fiber.objects.filter(conversation_id=conversation_id)
    if fibers.filter(status=Fiber.Status.RUNNING).exists():
        return None
    return (
        fibers.filter(status=Fiber.Status.PENDING).order_by("created_at").values_list("pk", flat=True).first()
    )


def fibers_mark_resent(*, ids: Sequence[Any]) -> None:
    """Pending fibers whose task was sent again: their wait for the next resend starts now."""
    Fiber.objects.filter(pk__in=ids, status=Fiber.Status.PENDING).update(heartbeat_at=Now())


def fiber_stash(*, fiber_id: FiberId, fencing: int, data: Any) -> None:
    """Store user data in the running fiber's snapshot (`ctx.recovery_data` on recovery), fenced.

    Only STASH_SLOT changes, in one statement: the stream's segment writes set CURSOR_SLOT beside it.
    """
    try:
        encoded = json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"stash() needs JSON-serialisable data: {exc}") from None
    if not _slot_set(STASH_SLOT, encoded, fiber_id=fiber_id, fencing=fencing):
        raise LeaseLost(f"fiber {fiber_id} fencing {fencing}")


def fiber_spend_add(
    *, fiber_id: FiberId, fencing: int, input_tokens: int, output_tokens: int, cached_tokens: int, cost: Any
) -> bool:
    """Add one model step's spend to the running fiber, fenced; False when it is no longer ours. `cost`
    None (an unpriced model) leaves the cost as it is."""
    cost_sql = ", cost = coalesce(cost, 0) + %(cost)s" if cost is not None else ""
    params = {
        "fiber": fiber_id,
        "fencing": fencing,
        "input": input_tokens,
        "output": output_tokens,
        "cached": cached_tokens,
        "cost": cost,
    }
    with connection.cursor() as cursor:  # raw: once per model step of every turn (issue 37)
        cursor.execute(_SPEND_ADD.format(fiber=Fiber._meta.db_table, cost=cost_sql), params)
        return cursor.rowcount > 0


_SPEND_ADD = """
UPDATE {fiber} SET input_tokens = input_tokens + %(input)s, output_tokens = output_tokens + %(output)s,
    cached_tokens = cached_tokens + %(cached)s{cost}
WHERE id = %(fiber)s AND fencing = %(fencing)s AND status = 'running'
"""


def fiber_interrupted(fiber_id: FiberId) -> bool:
    """Whether the fiber still waits for the recovery engine (a stop cancels it)."""
    return Fiber.objects.filter(pk=fiber_id, status=Fiber.Status.INTERRUPTED).exists()


def fiber_spend(fiber_id: FiberId) -> tuple[int, Any]:
    """What a fiber spent: its tokens (input + output) and its cost (None when unpriced)."""
    row = Fiber.objects.filter(pk=fiber_id).values_list("input_tokens", "output_tokens", "cost").first()
    return (0, None) if row is None else (row[0] + row[1], row[2])


def fiber_trace_record(*, fiber_id: FiberId, fencing: int, carrier: dict[str, str]) -> bool:
    """Record the trace context of the fiber's run (TRACE_SLOT), for the spans of its recovery; fenced,
    False when the fiber is no longer ours."""
    return _slot_set(TRACE_SLOT, json.dumps(carrier), fiber_id=fiber_id, fencing=fencing)


def _slot_set(slot: str, encoded: str, *, fiber_id: FiberId, fencing: int) -> bool:
    """Set one slot of a running fiber's snapshot in one fenced statement; False when it is not ours."""
    sql = (
        f"UPDATE {Fiber._meta.db_table}"
        " SET snapshot = jsonb_set(COALESCE(snapshot, '{}'::jsonb), %s::text[], %s::jsonb)"
        " WHERE id = %s AND fencing = %s AND status = %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [[slot], encoded, fiber_id, fencing, Fiber.Status.RUNNING])
        return bool(cursor.rowcount)


def fiber_mark_recovered(*, fiber_id: FiberId) -> None:
    """The engine has handled an interrupted fiber (its continuation, if any, is a fiber of its own)."""
    Fiber.objects.filter(pk=fiber_id, status=Fiber.Status.INTERRUPTED).update(
        status=Fiber.Status.RECOVERED, finished_at=Now(), lease_expires_at=None
    )


# -- handing a fiber to the recovery engine ------------------------------------------------------

# How long the engine may take to handle an interrupted fiber before another tick tries again.
HANDLING_TTL = timedelta(seconds=15)


RECOVERY_OWNER = "recovery"


def _TO_ENGINE() -> dict[str, Any]:  # noqa: N802 (a constant that needs a fresh Now())
    """The change that hands a fiber to the recovery engine: the fencing number moves on, so the
    worker that held it can write nothing more, and the engine holds it for HANDLING_TTL."""
    return {
        "status": Fiber.Status.INTERRUPTED,
        "fencing": F("fencing") + 1,
        "lease_owner": RECOVERY_OWNER,
        "lease_expires_at": Now() + HANDLING_TTL,
    }


def fibers_take_over(ids: Sequence[str], *, statuses: Sequence[str], reason: str) -> int:
    """Hand fibers to the engine now (an operator's forced recovery); a reason their worker recorded is
    kept ("worker_lost" spends the OOM budget), else `reason`."""
    return Fiber.objects.filter(pk__in=ids, status__in=statuses).update(
        interruption=Coalesce(NullIf(F("interruption"), Value("")), Value(reason)), **_TO_ENGINE()
    )


def fibers_take_expired(limit: int) -> list[tuple[Any, str]]:
    """Hand the fibers whose lease lapsed to the engine (the tick's claim, inside its transaction);
    their ids with the status they had (running, interrupted)."""
    expired = Fiber.objects.select_for_update(skip_locked=True).filter(
        Q(status=Fiber.Status.RUNNING) | Q(status=Fiber.Status.INTERRUPTED), lease_expires_at__lt=Now()
    )
    rows = list(expired.order_by("lease_expires_at").values_list("pk", "status")[:limit])
    Fiber.objects.filter(pk__in=[pk for pk, _ in rows]).update(**_TO_ENGINE())
    return rows


def fiber_interrupt(*, fiber_id: FiberId, fencing: int, reason: str = "") -> bool:
    """A worker hands its own fiber to recovery at once (stall, shutdown): fenced, so only the owner can."""
    return bool(
        Fiber.objects.filter(pk=fiber_id, fencing=fencing, status=Fiber.Status.RUNNING).update(
            interruption=reason, **_TO_ENGINE()
        )
    )


def fiber_mark_worker_lost(*, fiber_id: FiberId) -> bool:
    """Celery saw the pool child running this fiber die (SIGKILL, often the OOM killer)."""
    return bool(
        Fiber.objects.filter(pk=fiber_id, status=Fiber.Status.RUNNING).update(interruption="worker_lost")
    )


def fiber_release(*, fiber_id: FiberId, fencing: int) -> bool:
    """Let the lease lapse now, so the next tick hands the fiber to recovery (worker shutdown)."""
    return bool(
        Fiber.objects.filter(pk=fiber_id, fencing=fencing, status=Fiber.Status.RUNNING).update(
            lease_expires_at=Now() - timedelta(seconds=1)
        )
    )


# The fibers of processes whose liveness session is gone (recovery.lease.liveness), found in two sightings.
# A poll that finds a running fiber's key free (it try-locks the key for the rest of its transaction)
# marks the fiber; a later poll takes over a marked fiber whose key is still free and whose lease was not
# renewed since the mark, once the mark is LIVENESS_CONFIRM_MS old. A live process whose session dropped
# takes its key back, and renews its leases on every flush tick meanwhile, inside that window. Neither
# poll trusts a free key while the server is younger than the lease (after a restart nobody held one).
# A fiber whose lease has not been renewed for SETTLED_DEATH (longer than both sightings would take, ten
# flush ticks) and whose key is free is taken at its first sighting: its owner died before anyone was
# watching, the case of a worker that starts after its predecessor died (a deploy, a crash with no other
# worker up), which would otherwise wait two more polls for what its lease already says.
_SUSPECT = """
WITH candidates AS MATERIALIZED (
    SELECT id, lease_session FROM {fiber}
    WHERE status = 'running' AND lease_session IS NOT NULL AND heartbeat_at < now() - %(fresh)s
        AND (lease_lost_at IS NULL OR lease_lost_at < heartbeat_at)
        AND pg_postmaster_start_time() < now() - %(settle)s
    ORDER BY heartbeat_at LIMIT %(limit)s
)
UPDATE {fiber} AS f SET lease_lost_at = now()
FROM candidates AS c
WHERE f.id = c.id AND pg_try_advisory_xact_lock(c.lease_session)
RETURNING f.id
"""
_ORPHANED = """
WITH candidates AS MATERIALIZED (
    SELECT id, lease_session FROM {fiber}
    WHERE status = 'running' AND lease_session IS NOT NULL
        AND ((lease_lost_at < now() - %(confirm)s AND heartbeat_at < lease_lost_at)
            OR heartbeat_at < now() - %(settled)s)
        AND pg_postmaster_start_time() < now() - %(settle)s
    ORDER BY COALESCE(lease_lost_at, heartbeat_at) LIMIT %(limit)s
)
UPDATE {fiber} AS f SET status = 'interrupted', fencing = f.fencing + 1, lease_owner = %(recovery)s,
    lease_expires_at = now() + %(handling)s
FROM candidates AS c
WHERE f.id = c.id AND f.status = 'running' AND pg_try_advisory_xact_lock(c.lease_session)
RETURNING f.id
"""
# A lease renewed this recently is a live owner's whatever its session says (a streaming turn renews
# on every flush tick): such fibers are not even try-locked.
FRESH_LEASE = timedelta(milliseconds=150)
SETTLED_DEATH = timedelta(seconds=1)


def fibers_take_orphaned(*, limit: int = 100) -> list[Any]:
    """Hand the running fibers of dead worker processes to the engine, as an expired lease would be,
    and mark the ones seen without their owner's session for the next poll; the ids taken over. Call
    inside a transaction (the locks it takes last until its end)."""
    confirm = timedelta(milliseconds=float(setting("LIVENESS_CONFIRM_MS")))
    params: dict[str, Any] = {
        "fresh": FRESH_LEASE,
        "confirm": confirm,
        "settled": max(SETTLED_DEATH, FRESH_LEASE + 2 * confirm),
        "settle": lease_ttl(),
        "limit": limit,
        "recovery": RECOVERY_OWNER,
        "handling": HANDLING_TTL,
    }
    table = Fiber._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(_ORPHANED.format(fiber=table), params)
        taken = [row[0] for row in cursor.fetchall()]
        cursor.execute(_SUSPECT.format(fiber=table), params)
    return taken
