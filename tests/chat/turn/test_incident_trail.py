"""Incidents are the audit trail of recoveries: an incident reads "running" while the turn its recovery
started is queued or streaming, and stays, "completed", after that turn finished, where the admin's status
filter finds it (until THINK["INCIDENT_RETENTION_DAYS"], tests/recovery/test_retention.py).

The recovery runs in the test process through the real path (tests/inprocess.py): a turn interrupted at
"1 2 3", the engine, its continue alarm, and the continuation's run.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from chat.agents import open_agent
from chat.turn.runner import turn_run
from recovery.engine.alarms import afire_alarm
from recovery.engine.spine import arecover_fiber
from recovery.models import Incident
from tests.inprocess import interrupted_turn
from tests.support import TEST_PRINCIPAL

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("in_process_model")]


def admin_listing(**query: str) -> str:
    User.objects.filter(username="trail-admin").delete()
    user = User.objects.create_superuser("trail-admin", "trail@example.com", "pw")
    client = Client()
    client.force_login(user)
    response = client.get(reverse("admin:think_recovery_incident_changelist"), query)
    assert response.status_code == 200
    return response.content.decode()


async def status_of(incident: Incident) -> tuple[str, str]:
    await incident.arefresh_from_db()
    return incident.status, incident.reason


async def test_an_incident_reads_running_while_its_continuation_goes_and_stays_completed(
    quiet_broker: dict[str, list[Any]],
) -> None:
    name = f"trail-{uuid.uuid4().hex[:8]}"
    agent = await sync_to_async(open_agent)("assistant", name, owner=TEST_PRINCIPAL)
    interrupted = await interrupted_turn(agent, "count to 6 [stall after 3]")

    await arecover_fiber(interrupted.pk)
    incident = await Incident.objects.aget(conversation_id=agent.conversation_id)
    assert await status_of(incident) == ("scheduled", "")

    [alarm_id] = quiet_broker["alarms"]
    await afire_alarm(alarm_id)
    [fiber_id] = quiet_broker["turns"]  # the continuation is queued, not yet run
    assert await status_of(incident) == ("running", "")
    assert incident.incident_id in await sync_to_async(admin_listing)(status__exact="running")

    runner = await turn_run(str(fiber_id))
    assert runner is not None and runner.outcome == "completed"
    assert await status_of(incident) == ("completed", ""), "the record is kept, completed"
    assert (await sync_to_async(agent.messages)())[-1]["parts"][-1]["text"] == " 4 5 6"

    completed = await sync_to_async(admin_listing)(status__exact="completed")
    assert incident.incident_id in completed
    assert incident.incident_id not in await sync_to_async(admin_listing)(status__exact="running")
