"""Incidents in Postgres: the persistence around the pure budget function of incidents.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from recovery.budget.incidents import (
    INCIDENT_TTL_MS,
    LIVE_STATUSES,
    ChatRecovery,
    Evaluation,
    Incident,
    Spend,
    evaluate_incident,
    is_stale,
)
from recovery.lease.fibers import FiberId, fiber_interrupted, fiber_spend
from recovery.models import Incident as IncidentRow
from recovery.models import owner_model

# The reason of a live incident closed because nothing touched it for INCIDENT_TTL_MS.
EXPIRED = "expired"
_FIELDS = [f.name for f in dataclasses.fields(Incident)]


def _to_record(row: IncidentRow) -> Incident:
    values: dict[str, Any] = {name: getattr(row, name) for name in _FIELDS}
    values["reason"] = row.reason or None
    return Incident(**values)


def _write(conversation_id: int, incident: Incident) -> None:
    """Store the record, unless a stop cancelled it: an engine that was handling the turn when the stop
    committed must not reopen what the stop closed."""
    values = {name: getattr(incident, name) for name in _FIELDS if name != "incident_id"}
    values["reason"] = incident.reason or ""
    with transaction.atomic():
        rows = IncidentRow.objects.select_for_update().filter(
            conversation_id=conversation_id, incident_id=incident.incident_id
        )
        if rows.filter(status=IncidentRow.Status.CANCELLED).exists():
            return
        IncidentRow.objects.update_or_create(
            conversation_id=conversation_id, incident_id=incident.incident_id, defaults=values
        )


def incident_get(*, conversation_id: int, incident_id: str) -> Incident | None:
    row = IncidentRow.objects.filter(conversation_id=conversation_id, incident_id=incident_id).first()
    return None if row is None else _to_record(row)


def incident_save(*, conversation_id: int, incident: Incident) -> None:
    _write(conversation_id, incident)


def incidents_expire(*, conversation_id: int, now_ms: int) -> int:
    """Close live incidents inactive for more than INCIDENT_TTL_MS as skipped ("expired"); how many.

    Their budgets are spent (a later detection opens a fresh one); the records stay for the audit trail.
    """
    cutoff = now_ms - INCIDENT_TTL_MS
    stale = IncidentRow.objects.filter(conversation_id=conversation_id, status__in=LIVE_STATUSES).filter(
        Q(last_attempt_at__lt=cutoff) | Q(last_attempt_at__isnull=True, first_seen_at__lt=cutoff)
    )
    return stale.update(status=IncidentRow.Status.SKIPPED, reason=EXPIRED, updated_at=timezone.now())


def incidents_cancel(*, conversation_id: int, reason: str) -> list[Incident]:
    """Close every live incident of an owner as cancelled (a stop of the whole conversation): their
    alarms resume nothing (the owner's callbacks check), and no later write reopens them. The records
    stay for the audit trail. Call with the owner row locked; the closed records."""
    live = list(
        IncidentRow.objects.select_for_update().filter(
            conversation_id=conversation_id, status__in=LIVE_STATUSES
        )
    )
    closed = [_to_record(row) for row in live]
    IncidentRow.objects.filter(pk__in=[row.pk for row in live]).update(
        status=IncidentRow.Status.CANCELLED, reason=reason, updated_at=timezone.now()
    )
    return [
        dataclasses.replace(record, status=IncidentRow.Status.CANCELLED, reason=reason) for record in closed
    ]


def incident_cancelled(*, conversation_id: int, incident_id: str) -> bool:
    """A stop closed this incident: nothing of it may start."""
    return IncidentRow.objects.filter(
        conversation_id=conversation_id, incident_id=incident_id, status=IncidentRow.Status.CANCELLED
    ).exists()


def _budget(record: Incident | None, *, now_ms: int) -> Incident | None:
    """The record as a budget: a completed incident or one untouched past its TTL counts as none."""
    if record is None or record.status == IncidentRow.Status.COMPLETED or is_stale(record, now_ms=now_ms):
        return None
    return record


def incident_begin(
    *,
    conversation_id: int,
    incident_id: str,
    request_id: str,
    recovery_root_request_id: str,
    recovery_kind: str,
    config: ChatRecovery,
    now_ms: int,
    awaiting: bool,
    fiber_id: FiberId | None = None,
) -> Evaluation | None:
    """Open or re-evaluate an incident against the conversation's progress counter, and persist it;
    `fiber_id`: the interrupted run, whose spend counts when it was one of the recovery's attempts.

    None when that fiber is no longer interrupted: a stop (which takes the same lock) cancelled it after
    the engine loaded it, so there is nothing to recover and no incident is opened."""
    with transaction.atomic():
        progress = (
            owner_model()
            ._default_manager.select_for_update()
            .values_list("progress", flat=True)
            .get(pk=conversation_id)
        )
        if fiber_id is not None and not fiber_interrupted(fiber_id):
            return None
        incidents_expire(conversation_id=conversation_id, now_ms=now_ms)
        stored = incident_get(conversation_id=conversation_id, incident_id=incident_id)
        existing = _budget(stored, now_ms=now_ms)
        evaluation = evaluate_incident(
            existing=existing,
            incident_id=incident_id,
            request_id=request_id,
            recovery_root_request_id=recovery_root_request_id,
            recovery_kind=recovery_kind,
            progress=progress,
            config=config,
            now_ms=now_ms,
            awaiting=awaiting,
            spent=Spend(*fiber_spend(fiber_id)) if fiber_id is not None else None,
        )
        _write(conversation_id, evaluation.incident)
    return evaluation


def incident_set_status(
    *, conversation_id: int, incident_id: str, status: str, reason: str | None = None
) -> Incident | None:
    """Move an incident to a status (the record is kept, closed ones too, until its retention ends);
    None when there is no record."""
    with transaction.atomic():
        row = (
            IncidentRow.objects.select_for_update()
            .filter(conversation_id=conversation_id, incident_id=incident_id)
            .first()
        )
        if row is None:
            return None
        if row.status == IncidentRow.Status.CANCELLED:  # a stop closed it for good (incidents_cancel)
            return None
        row.status = status
        if reason is not None:
            row.reason = reason
        row.save(update_fields=["status", "reason", "updated_at"])
        return _to_record(row)


def incident_mark_running(*, conversation_id: int, incident_id: str) -> bool:
    """The recovery's turn is started: a live incident now reads "running" (call it in the transaction
    that creates the turn, so its end can never be overwritten). False when there was no live record."""
    live = IncidentRow.objects.filter(
        conversation_id=conversation_id, incident_id=incident_id, status__in=LIVE_STATUSES
    )
    return live.update(status=IncidentRow.Status.RUNNING, updated_at=timezone.now()) > 0
