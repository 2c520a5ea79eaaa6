"""Retention sweeps of stream buffers and closed incidents, and orphaned streams finalised on a resume ACK."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from celery import current_app
from django.utils import timezone

from chat.models import Conversation, Message
from chat.wire.resume import ack_replay
from recovery.checks import check_recovery_settings
from recovery.engine.schedules import beat_schedule
from recovery.models import Fiber, Incident, Segment, Stream
from recovery.operations.retention import incidents_sweep, streams_sweep

pytestmark = pytest.mark.django_db


@pytest.fixture
def conversation() -> Conversation:
    return Conversation.objects.create(agent="assistant", name="retention")


def stream(
    conversation: Conversation, request_id: str, status: str, *, age: timedelta, fiber: str | None
) -> Stream:
    owner = (
        Fiber.objects.create(conversation=conversation, request_id=request_id, status=fiber)
        if fiber
        else None
    )
    row = Stream.objects.create(
        conversation=conversation,
        fiber=owner,
        request_id=request_id,
        message_id=f"m-{request_id}",
        status=status,
    )
    when = timezone.now() - age
    Stream.objects.filter(pk=row.pk).update(
        created_at=when, completed_at=None if status == Stream.Status.STREAMING else when
    )
    Segment.objects.create(stream=row, seq_start=0, seq_end=0, body='{"type":"start"}', fencing=1)
    return row


def test_sweeps_finished_streams_after_ten_minutes_and_abandoned_ones_after_an_hour(
    conversation: Conversation,
) -> None:
    stream(conversation, "old-done", "completed", age=timedelta(minutes=11), fiber="completed")
    stream(conversation, "old-error", "error", age=timedelta(minutes=11), fiber="failed")
    stream(conversation, "recent-done", "completed", age=timedelta(minutes=5), fiber="completed")
    stream(conversation, "abandoned", "streaming", age=timedelta(hours=2), fiber="recovered")
    stream(conversation, "young-orphan", "streaming", age=timedelta(minutes=30), fiber=None)
    stream(conversation, "long-live", "streaming", age=timedelta(hours=2), fiber="running")
    assert streams_sweep() == 3
    kept = set(Stream.objects.values_list("request_id", flat=True))
    assert kept == {"recent-done", "young-orphan", "long-live"}, "an active stream is never swept"
    assert Segment.objects.count() == 3, "segments go with their stream"


def chunk(**fields: object) -> str:
    return json.dumps(fields, separators=(",", ":"))


def test_an_orphaned_stream_is_replayed_closed_and_its_message_stored_on_ack(
    conversation: Conversation,
) -> None:
    row = stream(conversation, "r1", "streaming", age=timedelta(minutes=1), fiber="completed")
    Segment.objects.filter(stream=row).delete()
    bodies = [
        chunk(type="start", messageId="m-r1"),
        chunk(type="start-step"),
        chunk(type="text-start", id="t"),
        chunk(type="text-delta", id="t", delta="half an answer"),
    ]
    Segment.objects.create(stream=row, seq_start=0, seq_end=3, body="\n".join(bodies), fencing=1)
    replay = ack_replay(conversation_id=conversation.pk, request_id="r1")
    frames = [json.loads(f) for f in replay.read_all()]
    assert [f.get("seq") for f in frames] == [0, 1, 2, 3, 4]
    assert all(f["replay"] for f in frames) and frames[-1]["done"] is True and frames[-1]["body"] == ""
    row.refresh_from_db()
    assert row.status == Stream.Status.COMPLETED
    stored = Message.objects.get(message_id="m-r1")
    assert stored.parts[-1]["text"] == "half an answer"
    assert replay.messages is not None and replay.messages.messages[-1]["id"] == "m-r1"


def test_a_stream_whose_turn_still_runs_is_replayed_live(conversation: Conversation) -> None:
    stream(conversation, "r2", "streaming", age=timedelta(seconds=5), fiber="running")
    replay = ack_replay(conversation_id=conversation.pk, request_id="r2")
    last = json.loads(replay.read_all()[-1])
    assert last["replayComplete"] is True and last["done"] is False and replay.messages is None


# -- closed incidents: the audit trail, kept for THINK["INCIDENT_RETENTION_DAYS"] ----------------------------
def incident(conversation: Conversation, incident_id: str, status: str, *, age: timedelta) -> None:
    row = Incident.objects.create(
        conversation=conversation,
        incident_id=incident_id,
        request_id=incident_id,
        recovery_root_request_id=incident_id,
        recovery_kind="continue",
        max_attempts=10,
        status=status,
        first_seen_at=0,
        last_attempt_at=0,
    )
    Incident.objects.filter(pk=row.pk).update(updated_at=timezone.now() - age)


def test_closed_incidents_stay_for_their_retention_and_live_ones_always(
    conversation: Conversation, settings: Any
) -> None:
    settings.THINK = {"INCIDENT_RETENTION_DAYS": 30}
    for status in ("completed", "skipped", "exhausted", "failed"):
        incident(conversation, f"old-{status}", status, age=timedelta(days=31))
        incident(conversation, f"recent-{status}", status, age=timedelta(days=29))
    for status in ("detected", "scheduled", "attempting", "running"):
        incident(conversation, f"live-{status}", status, age=timedelta(days=400))

    assert incidents_sweep(dry_run=True) == 4
    assert incidents_sweep() == 4

    kept = set(Incident.objects.values_list("incident_id", flat=True))
    assert kept == {f"recent-{s}" for s in ("completed", "skipped", "exhausted", "failed")} | {
        f"live-{s}" for s in ("detected", "scheduled", "attempting", "running")
    }


def test_no_retention_keeps_every_incident(conversation: Conversation, settings: Any) -> None:
    settings.THINK = {"INCIDENT_RETENTION_DAYS": None}
    incident(conversation, "ancient", "completed", age=timedelta(days=3650))
    assert incidents_sweep() == 0
    assert Incident.objects.count() == 1


def test_the_hourly_beat_entry_runs_the_incident_sweep(conversation: Conversation, settings: Any) -> None:
    settings.THINK = {"INCIDENT_RETENTION_DAYS": 1}
    incident(conversation, "old", "completed", age=timedelta(days=2))
    entry = beat_schedule()["think-incidents-sweep"]
    assert entry["schedule"] == 3600.0
    assert current_app.tasks[entry["task"]]() == 1
    assert not Incident.objects.exists()


@pytest.mark.parametrize("value", [0, -1, "30", True])
def test_a_bad_retention_is_a_system_check_error(settings: Any, value: Any) -> None:
    settings.THINK = {"INCIDENT_RETENTION_DAYS": value}
    [error] = check_recovery_settings()
    assert error.id == "think_recovery.E001" and "INCIDENT_RETENTION_DAYS" in error.msg
