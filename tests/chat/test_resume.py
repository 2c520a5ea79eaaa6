"""Answers to a resume probe (reference §3.4), read from Postgres."""

from __future__ import annotations

import time

import pytest

from chat.models import Conversation
from chat.resume import probe_answer
from recovery.incidents import RECOVERING_FLAG_TTL_MS
from recovery.models import Fiber, Stream

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
    snapshot = {"chat": {"requestId": "c1", "continuation": True, "ownerChannel": owner}}
    fiber = Fiber.objects.create(
        conversation=conversation, request_id="c1", status="running", snapshot=snapshot
    )
    Stream.objects.create(
        conversation=conversation, fiber=fiber, request_id="c1", message_id="m", is_continuation=True
    )


def test_a_continuation_is_owned_by_the_connection_that_answered_the_tool(conversation: Conversation) -> None:
    from asgiref.sync import async_to_sync

    from chat.presence import connection_join, connection_leave

    continuation_stream(conversation, owner="specific.owner!1")
    async_to_sync(connection_join)("specific.owner!1")
    try:
        other = probe_answer(conversation_id=conversation.pk, channel_name="specific.other!2")
        assert (other.kind, other.request_id) == ("continuation-owned", "c1")
        mine = probe_answer(conversation_id=conversation.pk, channel_name="specific.owner!1")
        assert mine.kind == "resuming"
    finally:
        async_to_sync(connection_leave)("specific.owner!1")
    gone = probe_answer(conversation_id=conversation.pk, channel_name="specific.other!2")
    assert gone.kind == "resuming", "an owner that left no longer holds the continuation"
