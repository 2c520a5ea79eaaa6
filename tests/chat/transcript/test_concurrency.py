"""Requests that arrive while a turn is busy: the message concurrency policy, and transcript order."""

from __future__ import annotations

from typing import Any

import pytest

from chat.agents import Think
from chat.models import Conversation
from chat.protocol import ChatRequest
from chat.transcript.finish import TurnOutcome, turn_finish
from chat.transcript.selectors import messages_list
from chat.transcript.turns import turn_accept
from recovery.lease.fibers import fiber_claim
from recovery.models import Fiber, Stream

pytestmark = pytest.mark.django_db


def user(message_id: str) -> dict[str, Any]:
    return {"id": message_id, "role": "user", "parts": [{"type": "text", "text": message_id}]}


def request(request_id: str, *messages: dict[str, Any]) -> ChatRequest:
    return ChatRequest(request_id, list(messages), "submit-message")


@pytest.fixture
def conversation() -> Conversation:
    return Conversation.objects.create(agent="assistant", name="busy")


def finish(conversation: Conversation, request_id: str, text: str) -> None:
    fiber = Fiber.objects.get(conversation=conversation, request_id=request_id)
    claim = fiber_claim(fiber_id=fiber.pk, owner="test")
    assert claim is not None
    message = {"id": f"a-{request_id}", "role": "assistant", "parts": [{"type": "text", "text": text}]}
    outcome = TurnOutcome(Fiber.Status.COMPLETED, Stream.Status.COMPLETED, message)
    turn_finish(
        fiber_id=fiber.pk,
        fencing=claim.fencing,
        conversation_id=conversation.pk,
        stream_id=None,
        outcome=outcome,
    )


def test_queue_runs_later_and_the_answer_stays_next_to_its_question(conversation: Conversation) -> None:
    turn_accept(conversation_id=conversation.pk, request=request("r1", user("u1")))
    second = turn_accept(conversation_id=conversation.pk, request=request("r2", user("u1"), user("u2")))
    assert not second.dropped and Fiber.objects.get(request_id="r2").status == Fiber.Status.PENDING
    finish(conversation, "r1", "answer 1")
    assert [m["id"] for m in messages_list(conversation_id=conversation.pk)] == ["u1", "a-r1", "u2"]
    finish(conversation, "r2", "answer 2")
    assert [m["id"] for m in messages_list(conversation_id=conversation.pk)] == ["u1", "a-r1", "u2", "a-r2"]


def test_drop_refuses_a_request_while_a_turn_is_busy_and_stores_nothing(conversation: Conversation) -> None:
    turn_accept(conversation_id=conversation.pk, request=request("r1", user("u1")), policy="drop")
    dropped = turn_accept(conversation_id=conversation.pk, request=request("r2", user("u2")), policy="drop")
    assert dropped.dropped and dropped.fiber_id is None
    assert [m["id"] for m in messages_list(conversation_id=conversation.pk)] == ["u1"]
    assert not Fiber.objects.filter(request_id="r2").exists()


def test_latest_cancels_turns_still_waiting_in_the_queue(conversation: Conversation) -> None:
    for n in (1, 2):
        turn_accept(conversation_id=conversation.pk, request=request(f"r{n}", user(f"u{n}")), policy="latest")
    Fiber.objects.filter(request_id="r1").update(status=Fiber.Status.RUNNING)
    latest = turn_accept(conversation_id=conversation.pk, request=request("r3", user("u3")), policy="latest")
    assert latest.superseded == ("r2",)
    statuses = dict(Fiber.objects.values_list("request_id", "status"))
    assert statuses == {"r1": "running", "r2": "cancelled", "r3": "pending"}
    assert [m["id"] for m in messages_list(conversation_id=conversation.pk)] == ["u1", "u2", "u3"]


def test_an_unknown_policy_is_reported_by_the_checks() -> None:
    class Merging(Think):
        message_concurrency = "merge"

    assert [error.id for error in Merging.check()] == ["think_chat.E014"]
