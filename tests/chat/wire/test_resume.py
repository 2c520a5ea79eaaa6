"""Answers to a resume probe, read from Postgres."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any
from unittest import mock

import pytest
import redis
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

import chat.wire.resume
from chat.models import Conversation, Message
from chat.transcript.snapshot import TurnKind, TurnSnapshot
from chat.wire import layers
from chat.wire.resume import ack_replay, probe_answer
from recovery.budget.incidents import RECOVERING_FLAG_TTL_MS
from recovery.models import Fiber, Segment, Stream

pytestmark = pytest.mark.django_db


@pytest.fixture
def conversation() -> Conversation:
    return Conversation.objects.create(agent="assistant", name="probe")


def test_idle_when_nothing_runs(conversation: Conversation) -> None:
    assert probe_answer(conversation_id=conversation.pk).kind == "idle"


def test_a_pre_stream_turn_parks_the_probe(conversation: Conversation) -> None:
    Fiber.objects.create(conversation=conversation, request_id="r1")
    answer = probe_answer(conversation_id=conversation.pk)
    assert (answer.kind, answer.request_id) == ("pending", "r1")


def test_an_active_stream_is_resumed(conversation: Conversation) -> None:
    fiber = Fiber.objects.create(conversation=conversation, request_id="r1", status="running")
    Stream.objects.create(conversation=conversation, fiber=fiber, request_id="r1", message_id="m")
    answer = probe_answer(conversation_id=conversation.pk)
    assert (answer.kind, answer.request_id) == ("resuming", "r1")


def test_while_recovery_owns_the_turn_the_probe_waits_instead_of_hearing_idle(
    conversation: Conversation,
) -> None:
    conversation.recovering = {"requestId": "r1", "at": int(time.time() * 1000)}
    conversation.save()
    answer = probe_answer(conversation_id=conversation.pk)
    assert (answer.kind, answer.request_id) == ("pending", "r1")


def test_a_stale_recovering_flag_is_ignored(conversation: Conversation) -> None:
    conversation.recovering = {
        "requestId": "r1",
        "at": int(time.time() * 1000) - RECOVERING_FLAG_TTL_MS - 1000,
    }
    conversation.save()
    assert probe_answer(conversation_id=conversation.pk).kind == "idle"


def test_a_terminal_record_is_resumed_for_late_delivery(conversation: Conversation) -> None:
    conversation.last_terminal = {"requestId": "r9", "body": "it failed"}
    conversation.save()
    answer = probe_answer(conversation_id=conversation.pk)
    assert (answer.kind, answer.request_id) == ("resuming", "r9")


def continuation_stream(conversation: Conversation, owner: str) -> None:
    snapshot = TurnSnapshot(request_id="c1", continuation=True, owner_channel=owner or None).envelope()
    fiber = Fiber.objects.create(
        conversation=conversation,
        request_id="c1",
        kind=TurnKind.CONTINUE,
        status="running",
        snapshot=snapshot,
    )
    Stream.objects.create(
        conversation=conversation, fiber=fiber, request_id="c1", message_id="m", is_continuation=True
    )


def test_a_continuation_is_owned_by_the_connection_that_answered_the_tool(conversation: Conversation) -> None:
    """The owner's consumer runs in another web process: its channel is subscribed there."""
    owner = f"specific.owner-{uuid.uuid4().hex}"
    continuation_stream(conversation, owner=owner)
    address = settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]["address"]
    listener = redis.Redis.from_url(address).pubsub()
    listener.subscribe(owner)
    try:
        other = probe_answer(conversation_id=conversation.pk, channel_name="specific.other!2")
        assert (other.kind, other.request_id) == ("continuation-owned", "c1")
        mine = probe_answer(conversation_id=conversation.pk, channel_name=owner)
        assert mine.kind == "resuming"
        listener.unsubscribe(owner)
        while (listener.get_message(timeout=5) or {}).get("type") != "unsubscribe":
            pass
    finally:
        listener.close()
    gone = probe_answer(conversation_id=conversation.pk, channel_name="specific.other!2")
    assert gone.kind == "resuming", "an owner that left no longer holds the continuation"


@pytest.mark.django_db(transaction=True)
async def test_an_owner_in_this_process_is_known_without_asking_redis(conversation: Conversation) -> None:
    layer = get_channel_layer()
    assert layer is not None
    owner = await layer.new_channel()  # as a consumer of this process gets its channel
    await sync_to_async(continuation_stream)(conversation, owner=owner)
    with mock.patch.object(layers, "_subscribers", side_effect=AssertionError("asked Redis")):
        answer = await sync_to_async(probe_answer)(
            conversation_id=conversation.pk, channel_name="specific.x!1"
        )
    assert answer.kind == "continuation-owned"


def approval_continuation(conversation: Conversation) -> tuple[dict[str, Any], Stream]:
    """An approval continuation running: its message holds the approved call, two chunks are stored."""
    call = {"toolCallId": "call_1", "type": "tool-delete_file", "input": {}}
    approved = {**call, "state": "approval-responded", "approval": {"id": "a1", "approved": True}}
    Message.objects.create(
        conversation=conversation, message_id="m", role="assistant", parts=[approved], position=0
    )
    continuation_stream(conversation, owner="")
    stream = Stream.objects.get(request_id="c1")
    chunks = [{"type": "start"}, {"type": "tool-output-available", "toolCallId": "call_1", "output": "done"}]
    body = "\n".join(json.dumps(c, separators=(",", ":")) for c in chunks)
    Segment.objects.create(stream=stream, seq_start=0, seq_end=1, body=body, fencing=0)
    return call, stream


def finish(call: dict[str, Any], stream: Stream) -> None:
    """What the turn's end commits: the message with the continuation's parts, stream and fiber closed."""
    settled = {**call, "state": "output-available", "output": "done"}
    Message.objects.filter(message_id="m").update(parts=[settled, {"type": "text", "text": "ok"}])
    Stream.objects.filter(pk=stream.pk).update(status=Stream.Status.COMPLETED)
    Fiber.objects.filter(request_id="c1").update(status=Fiber.Status.COMPLETED)


def test_an_ack_seeing_the_stream_run_and_then_the_message_finished_is_answered_as_finished(
    conversation: Conversation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn ends between the ACK's read of the stream and of the message. The message read then
    already holds the continuation's chunks: replayed as well, they would show twice."""
    call, stream = approval_continuation(conversation)
    read = chat.wire.resume._extended_message

    def finish_then_read(s: Stream) -> dict[str, Any] | None:
        finish(call, stream)
        return read(s)

    monkeypatch.setattr(chat.wire.resume, "_extended_message", finish_then_read)
    replay = ack_replay(conversation_id=conversation.pk, request_id="c1")
    bodies = [json.loads(f)["body"] for f in replay.read_all()]
    assert bodies == [""], "a finished continuation's chunks are in the message: only its end is sent"
    assert json.loads(replay.read_all()[-1])["done"] is True
    assert replay.snapshot is not None and replay.snapshot.messages[0]["parts"][1] == {
        "type": "text",
        "text": "ok",
    }


def test_an_ack_racing_the_end_while_reading_chunks_replays_them_as_the_continuation(
    conversation: Conversation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn ends while the chunks are read, after the message was: that message does not hold
    them, so they are replayed, as the continuation the client appends to the approved call."""
    call, stream = approval_continuation(conversation)
    read = chat.wire.resume.stream_chunks

    def read_then_finish(stream_id: object, **kwargs: Any) -> list[tuple[int, str]]:
        found = read(stream_id, **kwargs)
        finish(call, stream)
        return found

    monkeypatch.setattr(chat.wire.resume, "stream_chunks", read_then_finish)
    replay = ack_replay(conversation_id=conversation.pk, request_id="c1")
    frames = [json.loads(f) for f in replay.read_all()]
    assert [json.loads(f["body"]) for f in frames[:2]] == [
        {"type": "start"},
        {"type": "tool-output-available", "toolCallId": "call_1", "output": "done"},
    ]
    assert all(f["continuation"] for f in frames), "appended to the message the client shows"
    assert frames[-1]["replayComplete"] is True
