"""Stream buffer retention sweeps, and orphaned streams finalised on a resume ACK."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from chat.models import Conversation, Message
from chat.wire.resume import ack_replay
from recovery.models import Fiber, Segment, Stream
from recovery.retention import streams_sweep

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
