"""Retention of stream buffers: replayable for a while after they end, then swept.

A finished stream stays 10 minutes, so a client that reconnects just after the end still gets its
replay; a stream left `streaming` with no live or recovering turn is abandoned and goes after an hour.
Messages are never touched: the transcript does not depend on the buffers.
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Q, QuerySet
from django.utils import timezone

from .models import Fiber, Stream

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
