"""Detection: the beat tick that finds interrupted fibers and due alarms.

One short transaction with SKIP LOCKED, so overlapping ticks (or several beat-driven workers) never
claim the same row twice and never wait on each other. Claiming an expired fiber bumps its fencing
number: from that moment the worker that held it cannot write a chunk, a frame or a final message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from recovery.conf import claims_per_tick, setting
from recovery.engine.alarms import alarms_claim_due
from recovery.engine.targets import recovery_target
from recovery.lease.fibers import fibers_mark_resent, fibers_take_expired, fibers_take_orphaned
from recovery.models import Fiber
from recovery.observe import metrics
from recovery.observe.heartbeat import beat_touch
from recovery.process import dispatch

logger = logging.getLogger(__name__)


@dataclass
class TickClaims:
    fibers: list[Any] = field(default_factory=list)
    alarms: list[int] = field(default_factory=list)


def tick_claim(*, limit: int | None = None) -> TickClaims:
    """Claim the fibers of dead workers (by their lost session, recovery.lease.liveness, or their expired
    lease) and due alarms in one transaction: at most `limit` fibers in all (by default
    THINK["RECOVERY_CLAIMS_PER_TICK"]), and as many alarms. The rest wait for the next tick, so hundreds
    of interrupted fibers are recovered in batches instead of flooding the workers at once."""
    limit = claims_per_tick() if limit is None else limit
    with transaction.atomic():
        orphaned = fibers_take_orphaned(limit=limit) if setting("LIVENESS_SESSIONS") else []
        expired = fibers_take_expired(limit - len(orphaned)) if len(orphaned) < limit else []
        fibers = [*orphaned, *(pk for pk, _ in expired)]
        claims = TickClaims(fibers=fibers, alarms=alarms_claim_due(limit=limit))
    metrics.session_losses_observed(len(orphaned))
    metrics.lease_expiries_observed(status for _, status in expired)
    return claims


# A pending fiber whose task was lost is sent again: its process died between commit and enqueue, or a
# worker took the task and died before claiming the fiber (acks_late: the broker gives such a task back
# only after its visibility timeout, hours). While the turn queue is empty, no task of it waits there,
# so it is sent again soon; while turns queue up, it may be one of them: it is sent after the long wait.
REQUEUE_AFTER = timedelta(seconds=30)
REQUEUE_IDLE_AFTER = timedelta(seconds=2)


def fibers_requeue_stale(*, limit: int = 100) -> int:
    """Enqueue again the head pending fiber of conversations where nothing runs and nothing moved.

    Delivering run_turn twice is harmless (the claim lets one through); each fiber is re-sent at most
    once per wait (REQUEUE_IDLE_AFTER while the turn queue is empty, else REQUEUE_AFTER), so a busy
    queue is not flooded.
    """
    stale = _pending_for(REQUEUE_IDLE_AFTER)
    if not stale.exists():
        return 0  # the common case, without a look at the broker
    if turn_queue_size() != 0:
        stale = _pending_for(REQUEUE_AFTER)
    conversations = list(stale.values_list("conversation_id", flat=True).distinct()[:limit])
    for conversation_id in conversations:
        fibers_mark_resent(
            ids=list(stale.filter(conversation_id=conversation_id).values_list("pk", flat=True))
        )
        recovery_target().enqueue_next(conversation_id)
    return len(conversations)


def _pending_for(wait: timedelta) -> Any:
    """Pending fibers older than `wait` that were not sent again within it either."""
    return Fiber.objects.filter(status=Fiber.Status.PENDING, created_at__lt=Now() - wait).filter(
        Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=Now() - wait)
    )


def turn_queue_size() -> int | None:
    """Messages waiting in the broker queue the target's task is routed to; None when the broker
    cannot tell."""
    from celery import current_app

    try:
        queue = current_app.amqp.router.route({}, recovery_target().task_name)["queue"].name
        with current_app.connection_for_read() as connection:
            channel: Any = connection.default_channel
            return int(channel.queue_declare(queue=queue, passive=True).message_count)
    except Exception as exc:
        if str(getattr(exc, "reply_code", "")) == "404":  # never declared: nothing was sent to it
            return 0
        logger.warning("the turn queue's length could not be read: %s", exc)  # the long wait it is
        return None


# Work an app adds to every recovery tick (name -> a function returning how many rows it settled).
_sweeps: dict[str, Callable[[], int]] = {}


def register_tick_sweep(name: str, sweep: Callable[[], int]) -> None:
    """Run `sweep` on every recovery tick (an app calls it in its AppConfig.ready()); its count is
    reported under `name` in the tick's result. A sweep that raises is logged and never stops the tick."""
    _sweeps[name] = sweep


def tick(limit: int | None = None) -> dict[str, int]:
    """One recovery tick: claim expired fibers and due alarms (one short SKIP LOCKED transaction, at most
    `limit` fibers: THINK["RECOVERY_CLAIMS_PER_TICK"] by default), hand each out to a worker, requeue lost
    pending turns and run the apps' sweeps; the counts."""
    limit = claims_per_tick() if limit is None else limit
    claims = tick_claim(limit=limit)
    beat_touch()
    requeued = fibers_requeue_stale(limit=limit)
    swept = {name: _sweep(name, sweep) for name, sweep in _sweeps.items()}
    for fiber_id in claims.fibers:
        dispatch.recover_later(str(fiber_id))
    for alarm_id in claims.alarms:
        dispatch.fire_later(alarm_id)
    if claims.fibers or claims.alarms:
        logger.info(
            "recovery tick: %s interrupted fibers, %s due alarms", len(claims.fibers), len(claims.alarms)
        )
    return {"fibers": len(claims.fibers), "alarms": len(claims.alarms), "requeued": requeued, **swept}


def _sweep(name: str, sweep: Callable[[], int]) -> int:
    try:
        return sweep()
    except Exception:  # never let it stop the tick that drives recovery
        logger.exception("%s sweep failed", name)
        return 0
