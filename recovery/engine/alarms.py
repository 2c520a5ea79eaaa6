"""Durable alarms: one-shot callbacks in Postgres, claimed by the beat tick when due.

Nothing here uses a Celery ETA or countdown: a wait longer than the broker's visibility timeout would
run the task twice, so long waits live in this table and the tick, firing every second, picks them up.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from recovery.engine.targets import owner_labels
from recovery.models import Alarm
from recovery.observe import diagnostics
from recovery.process.runtime import db

logger = logging.getLogger(__name__)

# An alarm claimed by a worker that died is fired again after this long.
ALARM_CLAIM_TTL = timedelta(seconds=30)

# What an alarm runs, by its callback name: (the owning conversation row, the alarm's payload).
AlarmCallback = Callable[[Any, dict[str, Any]], Awaitable[None]]
_callbacks: dict[str, AlarmCallback] = {}


def register_callback(name: str, callback: AlarmCallback) -> None:
    """Make `name` an alarm callback; an app calls it in its AppConfig.ready(), as it registers a
    ModelAdmin. Registering a name again replaces it (a reload)."""
    _callbacks[name] = callback


def registered_callback(name: str) -> AlarmCallback | None:
    return _callbacks.get(name)


def _key(conversation_id: int, callback: str, payload: dict[str, Any]) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{conversation_id}\x00{callback}\x00{canonical}".encode()).hexdigest()


def alarm_schedule(
    *, conversation_id: int, callback: str, payload: dict[str, Any], delay_s: float = 0, idempotent: bool
) -> Alarm:
    """Schedule a callback; an idempotent schedule joins a pending alarm of the same callback and payload."""
    due = Now() + timedelta(seconds=delay_s)
    key = _key(conversation_id, callback, payload) if idempotent else None
    if key is not None:
        existing = Alarm.objects.filter(idempotency_key=key).first()
        if existing is not None:
            return existing
    try:
        with transaction.atomic():
            return Alarm.objects.create(
                conversation_id=conversation_id,
                callback=callback,
                payload=payload,
                due_at=due,
                idempotency_key=key,
            )
    except IntegrityError:  # a concurrent idempotent schedule won the race
        return Alarm.objects.get(idempotency_key=key)


def alarms_claim_due(*, limit: int) -> list[int]:
    """Claim due alarms (and ones whose claimer died) with SKIP LOCKED; call inside the tick's transaction."""
    stale = Now() - ALARM_CLAIM_TTL
    due = Alarm.objects.select_for_update(skip_locked=True).filter(
        Q(status=Alarm.Status.PENDING, due_at__lte=Now())
        | Q(status=Alarm.Status.RUNNING, claimed_at__lt=stale)
    )
    ids = list(due.order_by("due_at").values_list("pk", flat=True)[:limit])
    Alarm.objects.filter(pk__in=ids).update(
        status=Alarm.Status.RUNNING, claimed_at=Now(), attempts=F("attempts") + 1
    )
    return ids


def alarm_claim(*, alarm_id: int) -> bool:
    """Claim one due alarm now (the engine fires a zero-delay alarm without waiting for the next tick)."""
    return bool(
        Alarm.objects.filter(pk=alarm_id, status=Alarm.Status.PENDING, due_at__lte=Now()).update(
            status=Alarm.Status.RUNNING, claimed_at=Now(), attempts=F("attempts") + 1
        )
    )


def alarm_done(*, alarm_id: int) -> None:
    Alarm.objects.filter(pk=alarm_id).delete()


def alarm_retry_later(*, alarm_id: int, delay_s: float) -> None:
    """Put a claimed alarm back, e.g. after a transient infrastructure error."""
    Alarm.objects.filter(pk=alarm_id).update(
        status=Alarm.Status.PENDING, due_at=Now() + timedelta(seconds=delay_s), claimed_at=None
    )


def alarms_cancel(*, conversation_id: int, callbacks: Sequence[str]) -> int:
    """Delete an owner's pending alarms of these callbacks (a stop: none of them may fire); how many.
    One already claimed runs on, and its callback finds its work closed."""
    deleted, _ = Alarm.objects.filter(
        conversation_id=conversation_id, callback__in=list(callbacks), status=Alarm.Status.PENDING
    ).delete()
    return deleted


def alarms_pending(*, conversation_id: int, callback: str | None = None) -> list[Alarm]:
    alarms = Alarm.objects.filter(conversation_id=conversation_id)
    if callback is not None:
        alarms = alarms.filter(callback=callback)
    return list(alarms)


def _load_running(alarm_id: int) -> tuple[Alarm, Any] | None:
    alarm = (
        Alarm.objects.filter(pk=alarm_id, status=Alarm.Status.RUNNING).select_related("conversation").first()
    )
    return None if alarm is None else (alarm, alarm.conversation)


async def afire_alarm(alarm_id: int) -> None:
    """Run one claimed alarm; infrastructure errors put it back, anything else is handled by its callback."""
    loaded = await db(_load_running, alarm_id)
    if loaded is None:
        return
    alarm, owner = loaded
    handler = registered_callback(alarm.callback)
    if handler is None:
        logger.error("alarm %s has unknown callback %r; dropped", alarm_id, alarm.callback)
        await db(alarm_done, alarm_id=alarm_id)
        return
    labels = owner_labels(owner)
    diagnostics.emit("schedule:execute", {"callback": alarm.callback, "id": alarm_id}, **labels)
    try:
        await handler(owner, dict(alarm.payload))
    except (OSError, ConnectionError) as exc:  # transient: keep the alarm and try again shortly
        diagnostics.emit(
            "schedule:retry", {"callback": alarm.callback, "id": alarm_id, "error": str(exc)}, **labels
        )
        await db(alarm_retry_later, alarm_id=alarm_id, delay_s=1)
        return
    await db(alarm_done, alarm_id=alarm_id)
