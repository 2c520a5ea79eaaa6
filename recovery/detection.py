"""Detection: the beat tick that finds interrupted fibers and due alarms.

One short transaction with SKIP LOCKED, so overlapping ticks (or several beat-driven workers) never
claim the same row twice and never wait on each other. Claiming an expired fiber bumps its fencing
number: from that moment the worker that held it cannot write a chunk, a frame or a final message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from . import metrics
from .alarms import alarms_claim_due
from .models import Fiber

logger = logging.getLogger(__name__)

# How long the engine may take to handle an interrupted fiber before another tick tries again.
HANDLING_TTL = timedelta(seconds=15)
RECOVERY_OWNER = "recovery"


@dataclass
class TickClaims:
    fibers: list[Any] = field(default_factory=list)
    alarms: list[int] = field(default_factory=list)


def _claim_interrupted(limit: int) -> list[tuple[Any, str]]:
    """Claim the fibers whose lease lapsed; their ids with the status they had (running, interrupted)."""
    expired = Fiber.objects.select_for_update(skip_locked=True).filter(
        Q(status=Fiber.Status.RUNNING) | Q(status=Fiber.Status.INTERRUPTED), lease_expires_at__lt=Now()
    )
    rows = list(expired.order_by("lease_expires_at").values_list("pk", "status")[:limit])
    Fiber.objects.filter(pk__in=[pk for pk, _ in rows]).update(
        status=Fiber.Status.INTERRUPTED,
        fencing=F("fencing") + 1,
        lease_owner=RECOVERY_OWNER,
        lease_expires_at=Now() + HANDLING_TTL,
    )
    return rows


def tick_claim(*, limit: int = 100) -> TickClaims:
    """Claim expired fibers and due alarms in one transaction."""
    with transaction.atomic():
        expired = _claim_interrupted(limit)
        claims = TickClaims(fibers=[pk for pk, _ in expired], alarms=alarms_claim_due(limit=limit))
    metrics.lease_expiries_observed(status for _, status in expired)
    return claims


def fiber_interrupt(*, fiber_id: Any, fencing: int, reason: str = "") -> bool:
    """A worker hands its own fiber to recovery at once (stall, shutdown): fenced, so only the owner can."""
    return bool(
        Fiber.objects.filter(pk=fiber_id, fencing=fencing, status=Fiber.Status.RUNNING).update(
            status=Fiber.Status.INTERRUPTED,
            interruption=reason,
            fencing=F("fencing") + 1,
            lease_owner=RECOVERY_OWNER,
            lease_expires_at=Now() + HANDLING_TTL,
        )
    )


def fiber_mark_worker_lost(*, fiber_id: Any) -> bool:
    """Celery saw the pool child running this fiber die (SIGKILL, often the OOM killer)."""
    return bool(
        Fiber.objects.filter(pk=fiber_id, status=Fiber.Status.RUNNING).update(interruption="worker_lost")
    )


def fiber_release(*, fiber_id: Any, fencing: int) -> bool:
    """Let the lease lapse now, so the next tick hands the fiber to recovery (worker shutdown)."""
    return bool(
        Fiber.objects.filter(pk=fiber_id, fencing=fencing, status=Fiber.Status.RUNNING).update(
            lease_expires_at=Now() - timedelta(seconds=1)
        )
    )


# A pending fiber whose task was lost (its process died between commit and enqueue) runs after this long.
REQUEUE_AFTER = timedelta(seconds=30)


def fibers_requeue_stale(*, limit: int = 100) -> int:
    """Enqueue again the head pending fiber of conversations where nothing runs and nothing moved.

    Delivering run_turn twice is harmless (the claim lets one through); each fiber is re-sent at most
    once per REQUEUE_AFTER, so a busy queue is not flooded.
    """
    from chat.services import turn_enqueue_next

    stale = Fiber.objects.filter(status=Fiber.Status.PENDING, created_at__lt=Now() - REQUEUE_AFTER).filter(
        Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=Now() - REQUEUE_AFTER)
    )
    conversations = list(stale.values_list("conversation_id", flat=True).distinct()[:limit])
    for conversation_id in conversations:
        stale.filter(conversation_id=conversation_id).update(heartbeat_at=Now())
        turn_enqueue_next(conversation_id=conversation_id)
    return len(conversations)
