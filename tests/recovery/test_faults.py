"""Faults: the details behind a public "error 3f2a9c1e", stored, found in the admin by that reference,
and swept with the incidents' retention."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery import current_app
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from chat.models import Conversation
from recovery.engine.schedules import beat_schedule
from recovery.models import Fault, fault_reference
from recovery.operations.faults import fault_record
from recovery.operations.retention import faults_sweep

pytestmark = pytest.mark.django_db

SECRET = "postgres://admin:pw@10.0.0.5/db"


def record(conversation: Conversation | None = None, *, age: timedelta = timedelta(0)) -> Fault:
    try:
        raise ConnectionError(f"could not connect to {SECRET}")
    except ConnectionError as exc:
        row = fault_record(
            fault_id=uuid.uuid4(),
            kind=Fault.Kind.TOOL,
            error=exc,
            conversation_id=conversation.pk if conversation else None,
            request_id="r-1",
        )
    Fault.objects.filter(pk=row.pk).update(created_at=timezone.now() - age)
    return row


def test_a_fault_keeps_the_class_the_text_and_the_traceback() -> None:
    fault = Fault.objects.get(pk=record().pk)
    assert fault.error_class == "builtins.ConnectionError" and SECRET in fault.text
    assert "Traceback" in fault.traceback and "raise ConnectionError" in fault.traceback
    assert fault.reference == fault_reference(fault.id) == fault.id.hex[:8]


def test_the_admin_finds_a_fault_by_its_reference_and_changes_nothing(client: Client) -> None:
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    conversation = Conversation.objects.create(agent="assistant", name="faults")
    fault, other = record(conversation), record(conversation)
    url = reverse("admin:think_recovery_fault_changelist")
    found = client.get(url, {"q": fault.reference}).content.decode()
    assert fault.reference in found and other.reference not in found
    change = client.get(reverse("admin:think_recovery_fault_change", args=[fault.pk])).content.decode()
    assert SECRET in change and 'name="_save"' not in change
    assert client.get(reverse("admin:think_recovery_fault_add")).status_code == 403
    assert client.get(reverse("admin:think_recovery_fault_delete", args=[fault.pk])).status_code == 403


def test_faults_go_with_the_incident_retention(settings: Any) -> None:
    settings.THINK = {"INCIDENT_RETENTION_DAYS": 30}
    old, recent = record(age=timedelta(days=31)), record(age=timedelta(days=29))
    assert faults_sweep(dry_run=True) == 1
    current_app.tasks[beat_schedule()["think-incidents-sweep"]["task"]]()  # the hourly sweep
    assert list(Fault.objects.values_list("pk", flat=True)) == [recent.pk]
    assert not Fault.objects.filter(pk=old.pk).exists()


def test_no_retention_keeps_every_fault(settings: Any) -> None:
    settings.THINK = {"INCIDENT_RETENTION_DAYS": None}
    record(age=timedelta(days=3650))
    assert faults_sweep() == 0 and Fault.objects.count() == 1
