"""Retention of stream buffers and closed incidents.

A finished stream stays 10 minutes, so a client that reconnects just after the end still gets its
replay; a stream left `streaming` with no live or recovering turn is abandoned and goes after an hour.
Messages are never touched: the transcript does not depend on the buffers.

A closed incident (completed, skipped, exhausted, failed) is the audit trail of a recovery: it stays
THINK["INCIDENT_RETENTION_DAYS"] days after its last change (30 by default; None keeps it). Live ones
never go here. Faults (`recovery.operations.faults`) are kept as long, counted from when they were recorded.
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Q, QuerySet
from django.utils import timezone

from recovery.conf import setting
from recovery.models import Fault, Fiber, Incident, Stream

COMPLETED_RETENTION = timedelta(minutes=10)
ABANDONED_RETENTION = timedelta(hours=1)
LIVE_FIBERS = [Fiber.Status.PENDING, Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED]


def streams_expired(
    *, completed: timedelta = COMPLETED_RETENTION, abandoned: timedelta = ABANDONED_RETENTION
) -> QuerySet[Stream]:
    """Stream buffers past their retention: finished after `completed`, abandoned after `abandoned`."""
    now = timezone.now()
    finished = Q(status__in=[Stream.Status.COMPLETED, Stream.Status.ERROR], completed_at__lt=now - completed)
    left_open = Q(status=Stream.Status.STREAMING, created_at__lt=now - abandoned) & ~Q(
        fiber__status__in=LIVE_FIBERS
    )
    return Stream.objects.filter(finished | left_open)


def streams_sweep(
    *,
    completed: timedelta = COMPLETED_RETENTION,
    abandoned: timedelta = ABANDONED_RETENTION,
    dry_run: bool = False,
) -> int:
    """Delete expired stream buffers (and their segments); returns how many streams went (or would go)."""
    expired = streams_expired(completed=completed, abandoned=abandoned)
    if dry_run:
        return expired.count()
    deleted, per_model = expired.delete()
    return per_model.get(Stream._meta.label, 0)


CLOSED_INCIDENTS = [
    Incident.Status.COMPLETED,
    Incident.Status.SKIPPED,
    Incident.Status.EXHAUSTED,
    Incident.Status.FAILED,
]


def incidents_expired(*, older_than: timedelta) -> QuerySet[Incident]:
    """Closed incidents whose last change is more than `older_than` ago."""
    return Incident.objects.filter(status__in=CLOSED_INCIDENTS, updated_at__lt=timezone.now() - older_than)


def _incident_retention() -> timedelta | None:
    days = setting("INCIDENT_RETENTION_DAYS")
    return None if days is None else timedelta(days=days)


def incidents_sweep(*, older_than: timedelta | None = None, dry_run: bool = False) -> int:
    """Delete closed incidents past their retention (by default THINK["INCIDENT_RETENTION_DAYS"]; nothing
    when that is None); how many went (or would go)."""
    older_than = _incident_retention() if older_than is None else older_than
    if older_than is None:
        return 0
    expired = incidents_expired(older_than=older_than)
    if dry_run:
        return expired.count()
    return expired.delete()[1].get(Incident._meta.label, 0)


def faults_sweep(*, older_than: timedelta | None = None, dry_run: bool = False) -> int:
    """Delete faults recorded more than `older_than` ago (by default THINK["INCIDENT_RETENTION_DAYS"];
    nothing when that is None); how many went (or would go)."""
    older_than = _incident_retention() if older_than is None else older_than
    if older_than is None:
        return 0
    expired = Fault.objects.filter(created_at__lt=timezone.now() - older_than)
    if dry_run:
        return expired.count()
    return expired.delete()[1].get(Fault._meta.label, 0)
