"""Operator actions, shared by the admin actions and the management commands.

Each goes through the services the engine itself uses: a forced recovery claims fibers the way the beat
tick does (fencing number bumped, so the worker that held them can write nothing more; status
interrupted) and hands them to `think.recover_fiber`; a give-up and a cleared recovering flag are the
recovery target's (recovery.engine.targets: the owner's side); a sweep is one beat tick. Nothing here edits a
transcript.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import QuerySet
from django.db.models.functions import Now

from recovery.engine import detection
from recovery.engine.targets import recovery_target
from recovery.exceptions import OperationRefused
from recovery.lease.fibers import fibers_take_over
from recovery.models import Fiber, Incident
from recovery.operations.retention import ABANDONED_RETENTION, incidents_sweep, streams_sweep
from recovery.operations.retention import CLOSED_INCIDENTS as CLOSED_INCIDENTS
from recovery.process import dispatch

logger = logging.getLogger(__name__)

FORCED = "forced"
FORCEABLE = [Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED]
OPEN_INCIDENTS = [
    Incident.Status.DETECTED,
    Incident.Status.SCHEDULED,
    Incident.Status.ATTEMPTING,
    Incident.Status.RUNNING,
]


def epoch_ms_datetime(value: int | None) -> datetime | None:
    """Incident times are epoch milliseconds (the budget's clock); operators read datetimes."""
    return None if value is None else datetime.fromtimestamp(value / 1000, tz=UTC)


# --------------------------------------------------------------------------------------------------------
# Force recovery
# --------------------------------------------------------------------------------------------------------


def _enqueue(fiber_ids: list[str]) -> None:
    for fiber_id in fiber_ids:
        dispatch.recover_later(fiber_id)
        logger.info("recovery forced by an operator", extra={"fiber_id": fiber_id})


def _force(fibers: QuerySet[Fiber], *, dry_run: bool, limit: int | None = None) -> list[str]:
    """Claim running or interrupted fibers for the engine, as the tick does, and enqueue them after commit."""
    with transaction.atomic():
        locked = fibers.filter(status__in=FORCEABLE).select_for_update().order_by("lease_expires_at", "pk")
        ids = [str(pk) for pk in locked.values_list("pk", flat=True)[:limit]]
        if ids and not dry_run:
            fibers_take_over(ids, statuses=FORCEABLE, reason=FORCED)
            transaction.on_commit(lambda: _enqueue(ids))
    return ids


def fiber_force_recover(*, fiber_id: Any, dry_run: bool = False) -> str:
    """Hand one running (live or not) or interrupted fiber to the engine now; its id."""
    try:
        fiber = Fiber.objects.filter(pk=fiber_id).first()
    except (ValueError, ValidationError):
        raise OperationRefused(f"{fiber_id!r} is not a fiber id") from None
    if fiber is None:
        raise OperationRefused(f"fiber {fiber_id} does not exist")
    if fiber.status not in FORCEABLE:
        raise OperationRefused(
            f"fiber {fiber_id} is {fiber.status}: only a running or interrupted fiber can be recovered"
        )
    forced = _force(Fiber.objects.filter(pk=fiber.pk), dry_run=dry_run)
    if not forced:
        raise OperationRefused(f"fiber {fiber_id} finished meanwhile")
    return forced[0]


def conversation_force_recover(*, conversation_id: int, dry_run: bool = False) -> list[str]:
    """Hand every running or interrupted fiber of a conversation to the engine now; their ids."""
    return _force(Fiber.objects.filter(conversation_id=conversation_id), dry_run=dry_run)


def fibers_force_recover_stale(
    *, older_than: float = 0, limit: int | None = None, dry_run: bool = False
) -> list[str]:
    """Running fibers whose lease expired more than `older_than` seconds ago, oldest first; their ids."""
    if older_than < 0:
        raise ValueError("older_than must be zero or more seconds")
    if limit is not None and limit < 1:
        raise ValueError("limit must be at least 1")
    stale = Fiber.objects.filter(
        status=Fiber.Status.RUNNING, lease_expires_at__lt=Now() - timedelta(seconds=older_than)
    )
    return _force(stale, dry_run=dry_run, limit=limit)


# --------------------------------------------------------------------------------------------------------
# Give up, clear the recovering flag
# --------------------------------------------------------------------------------------------------------


def _give_up(incident: Incident) -> None:
    recovery_target().give_up(incident, reason=FORCED)
    logger.info(
        "recovery given up by an operator",
        extra={"conversation_id": incident.conversation_id, "incident_id": incident.incident_id},
    )


def incident_give_up(*, incident_pk: int) -> None:
    """Give up on one open incident now: the terminal message goes out and nothing more is attempted."""
    incident = Incident.objects.select_related("conversation").filter(pk=incident_pk).first()
    if incident is None:
        raise OperationRefused(f"incident {incident_pk} does not exist")
    if incident.status not in OPEN_INCIDENTS:
        raise OperationRefused(f"incident {incident.incident_id} is {incident.status}, not open")
    _give_up(incident)


def conversation_give_up(*, conversation_id: int) -> int:
    """Give up on every open incident of a conversation; how many there were."""
    incidents = list(
        Incident.objects.select_related("conversation").filter(
            conversation_id=conversation_id, status__in=OPEN_INCIDENTS
        )
    )
    for incident in incidents:
        _give_up(incident)
    return len(incidents)


def conversation_clear_recovering(*, conversation_id: int) -> bool:
    """Clear a stuck recovering flag and tell the clients; False when there was none."""
    return recovery_target().clear_recovering(conversation_id)


# --------------------------------------------------------------------------------------------------------
# Sweep, prune, report
# --------------------------------------------------------------------------------------------------------


def recovery_sweep(*, limit: int | None = None) -> dict[str, int]:
    """What the beat tick does, once: claim expired fibers and due alarms, hand them out; the counts."""
    return detection.tick(limit=limit)


def streams_prune(*, older_than_minutes: float = 10, dry_run: bool = False) -> int:
    """Delete stream buffers finished more than N minutes ago; abandoned ones keep at least their hour."""
    if older_than_minutes < 0:
        raise ValueError("older_than_minutes must be zero or more")
    completed = timedelta(minutes=older_than_minutes)
    return streams_sweep(completed=completed, abandoned=max(completed, ABANDONED_RETENTION), dry_run=dry_run)


def incidents_prune(*, older_than_days: float = 7, dry_run: bool = False) -> int:
    """Delete closed incidents (completed, skipped, exhausted, failed) untouched for more than N days."""
    if older_than_days < 0:
        raise ValueError("older_than_days must be zero or more")
    return incidents_sweep(older_than=timedelta(days=older_than_days), dry_run=dry_run)


def incidents_report(*, statuses: Sequence[str]) -> list[dict[str, Any]]:
    """Incidents in the given statuses, newest first, as plain JSON-ready rows."""
    rows = Incident.objects.select_related("conversation").filter(status__in=statuses).order_by("-updated_at")
    return [
        {
            "conversation": str(row.conversation),
            "incident_id": row.incident_id,
            "status": row.status,
            "reason": row.reason,
            "recovery_kind": row.recovery_kind,
            "attempt": row.attempt,
            "max_attempts": row.max_attempts,
            "first_seen_at": _iso(row.first_seen_at),
            "last_attempt_at": _iso(row.last_attempt_at),
            "updated_at": row.updated_at.isoformat(),
        }
        for row in rows
    ]


def _iso(value: int | None) -> str | None:
    moment = epoch_ms_datetime(value)
    return None if moment is None else moment.isoformat()
