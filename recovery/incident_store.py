"""Incidents in Postgres: the persistence around the pure budget function of incidents.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from django.db import transaction
from django.db.models import Q

from .incidents import INCIDENT_TTL_MS, ChatRecovery, Evaluation, Incident, evaluate_incident
from .models import Incident as IncidentRow
from .models import owner_model

_FIELDS = [f.name for f in dataclasses.fields(Incident)]


def _to_record(row: IncidentRow) -> Incident:
    values: dict[str, Any] = {name: getattr(row, name) for name in _FIELDS}
    values["reason"] = row.reason or None
    return Incident(**values)


def _write(conversation_id: int, incident: Incident) -> None:
    values = {name: getattr(incident, name) for name in _FIELDS if name != "incident_id"}
    values["reason"] = incident.reason or ""
    IncidentRow.objects.update_or_create(
        conversation_id=conversation_id, incident_id=incident.incident_id, defaults=values
    )


def incident_get(*, conversation_id: int, incident_id: str) -> Incident | None:
    row = IncidentRow.objects.filter(conversation_id=conversation_id, incident_id=incident_id).first()
    return None if row is None else _to_record(row)


def incident_save(*, conversation_id: int, incident: Incident) -> None:
    _write(conversation_id, incident)


def incidents_sweep(*, conversation_id: int, now_ms: int) -> int:
    """Delete incidents inactive for more than an hour (sweep before read)."""
    cutoff = now_ms - INCIDENT_TTL_MS
    stale = IncidentRow.objects.filter(conversation_id=conversation_id).filter(
        Q(last_attempt_at__lt=cutoff) | Q(last_attempt_at__isnull=True, first_seen_at__lt=cutoff)
    )
    return stale.delete()[0]


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
) -> Evaluation:
    """Open or re-evaluate an incident against the conversation's progress counter, and persist it."""
    with transaction.atomic():
        progress = (
            owner_model()
            ._default_manager.select_for_update()
            .values_list("progress", flat=True)
            .get(pk=conversation_id)
        )
        incidents_sweep(conversation_id=conversation_id, now_ms=now_ms)
        existing = incident_get(conversation_id=conversation_id, incident_id=incident_id)
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
        )
        _write(conversation_id, evaluation.incident)
    return evaluation


def incident_set_status(
    *, conversation_id: int, incident_id: str, status: str, reason: str | None = None
) -> Incident | None:
    """Move an incident to a status; `completed` deletes the record. None when there is no record."""
    with transaction.atomic():
        row = (
            IncidentRow.objects.select_for_update()
            .filter(conversation_id=conversation_id, incident_id=incident_id)
            .first()
        )
        if row is None:
            return None
        record = _to_record(row)
        if status == IncidentRow.Status.COMPLETED:
            row.delete()
            return dataclasses.replace(record, status=status)
        row.status = status
        if reason is not None:
            row.reason = reason
        row.save(update_fields=["status", "reason", "updated_at"])
        return _to_record(row)
