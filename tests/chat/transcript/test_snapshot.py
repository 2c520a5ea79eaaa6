"""The fiber snapshot of a chat turn: one typed owner of its keys (chat.transcript.snapshot).

The stored JSON is what existing databases hold, so these tests pin its keys, the envelope's slots the
recovery layer patches in SQL, and the ORM lookups that filter on them.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from chat.models import Conversation
from chat.transcript.snapshot import FiberSnapshot, TurnKind, TurnSnapshot
from recovery.lease.fibers import STASH_SLOT, fiber_claim, fiber_create, fiber_stash
from recovery.models import Fiber
from recovery.stream.buffer import segment_append, stream_open


def envelope(**changes: Any) -> dict[str, Any]:
    chat = {"kind": "think-chat-turn", "version": 1, "requestId": "req-1", "continuation": False}
    return {"chat": {**chat, **changes}, "user": {"stashed": True}}


# The JSON a turn of the current schema stores (keys as written since the first release).
STORED = {
    "chat": {
        "kind": "think-chat-turn",
        "version": 1,
        "requestId": "r-2",
        "recoveryRootRequestId": "r-1",
        "continuation": True,
        "latestMessageId": "a-1",
        "latestMessageRole": "assistant",
        "latestUserMessageId": "u-1",
        "startedAt": "2026-12-01T10:00:00+00:00",
        "lastBody": {"custom": 1},
        "lastClientTools": [{"name": "ask"}],
        "incidentId": "inc-1",
    },
    "user": {"step": 3},
    "reattach": {"responseId": "resp-1", "after": 7},
}


def test_a_stored_snapshot_reads_into_its_fields() -> None:
    stored = FiberSnapshot.from_json(STORED)

    assert stored.turn == TurnSnapshot(
        request_id="r-2",
        continuation=True,
        recovery_root_request_id="r-1",
        latest_message_id="a-1",
        latest_message_role="assistant",
        latest_user_message_id="u-1",
        started_at="2026-12-01T10:00:00+00:00",
        last_body={"custom": 1},
        last_client_tools=[{"name": "ask"}],
        incident_id="inc-1",
    )
    assert stored.stash == {"step": 3}
    assert stored.cursor == {"responseId": "resp-1", "after": 7}


def test_a_snapshot_writes_the_json_it_reads() -> None:
    turn = FiberSnapshot.from_json(STORED).turn
    assert turn is not None

    assert turn.envelope(cursor=STORED["reattach"]) == {**STORED, "user": None}
    assert FiberSnapshot.from_json(turn.envelope()).turn == turn


def test_unset_optional_ids_are_left_out_of_the_json() -> None:
    turn = TurnSnapshot(request_id="r-1", continuation=False)

    stored = turn.to_json()

    assert not {"incidentId", "submissionId", "ownerChannel"} & set(stored)
    assert stored["lastBody"] is None and "lastBody" in stored


def test_a_continuation_of_an_assistant_leaf_extends_it_and_nothing_else_does() -> None:
    leaf = TurnSnapshot(
        request_id="r", continuation=True, latest_message_id="a-1", latest_message_role="assistant"
    )

    assert leaf.extends_assistant_message == "a-1"
    assert leaf.replace(latest_message_role="user").extends_assistant_message is None
    assert leaf.replace(continuation=False).extends_assistant_message is None
    assert leaf.root_request_id == "r"
    assert leaf.replace(recovery_root_request_id="r-0").root_request_id == "r-0"


def test_a_snapshot_accepts_the_versioned_envelope_and_returns_the_stash() -> None:
    wrapped = envelope(latestUserMessageId="u-1")

    stored = FiberSnapshot.from_json(wrapped)

    assert stored.turn == TurnSnapshot(request_id="req-1", continuation=False, latest_user_message_id="u-1")
    assert stored.stash == {"stashed": True}


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(envelope(kind="ai-chat-turn"), id="wrong-kind"),
        pytest.param(envelope(version=2), id="future-version"),
        pytest.param(envelope(version="1"), id="version-as-string"),
        pytest.param(
            {"chat": {"kind": "think-chat-turn", "version": 1, "continuation": False}}, id="no-request-id"
        ),
        pytest.param(envelope(requestId=7), id="request-id-not-a-string"),
        pytest.param(envelope(continuation="false"), id="continuation-not-a-bool"),
        pytest.param({"chat": "think-chat-turn"}, id="chat-not-an-object"),
    ],
)
def test_a_snapshot_rejects_anything_but_the_versioned_envelope(broken: dict[str, Any]) -> None:
    assert FiberSnapshot.from_json(broken).turn is None


@pytest.mark.parametrize(
    "legacy",
    [None, "raw stash", 42, ["a", "b"], {"step": 3}, {"__cfThinkChatFiberSnapshot": {"version": 1}}],
)
def test_a_value_that_is_not_our_envelope_is_returned_as_the_stash(legacy: Any) -> None:
    assert FiberSnapshot.from_json(legacy) == FiberSnapshot(None, legacy)


@pytest.mark.django_db
def test_the_lookups_and_the_layers_slots_meet_the_stored_json() -> None:
    """What the ORM filters on, what stash() and the segment writes patch, and what the claim reads back
    are the same keys: a renamed key fails here."""
    conversation = Conversation.objects.create(agent="assistant", name=f"snap-{uuid.uuid4().hex[:8]}")
    turn = TurnSnapshot(
        request_id="r-9", continuation=False, recovery_root_request_id="root", incident_id="inc-9"
    ).replace(submission_id="sub-9", owner_channel="chan-9")
    fiber = fiber_create(
        conversation_id=conversation.pk, request_id="r-9", kind=TurnKind.CHAT, snapshot=turn.envelope()
    )
    for name, value in [
        ("recovery_root_request_id", "root"),
        ("incident_id", "inc-9"),
        ("submission_id", "sub-9"),
        ("owner_channel", "chan-9"),
    ]:
        assert list(Fiber.objects.filter(**{TurnSnapshot.lookup(name): value})) == [fiber], name

    claimed = fiber_claim(fiber_id=fiber.pk, owner="test", fields=("agent", "last_client_tools"))
    assert claimed is not None
    assert claimed.conversation == {"id": conversation.pk, "agent": "assistant", "last_client_tools": None}
    fiber_stash(fiber_id=fiber.pk, fencing=claimed.fencing, data={"mine": 1})
    stream_id = stream_open(
        conversation_id=conversation.pk,
        fiber_id=fiber.pk,
        fencing=claimed.fencing,
        request_id="r-9",
        message_id="m-9",
        continuation=False,
    )
    cursor = '{"responseId": "resp-9", "after": 1}'
    segment_append(
        fiber_id=fiber.pk,
        fencing=claimed.fencing,
        stream_id=stream_id,
        seq_start=0,
        seq_end=0,
        body="{}",
        credit=1,
        reattach=cursor,
    )

    fiber.refresh_from_db()
    stored = FiberSnapshot.from_json(fiber.snapshot)
    assert stored.turn == turn
    assert stored.stash == {"mine": 1} == fiber.snapshot[STASH_SLOT]
    assert stored.cursor == {"responseId": "resp-9", "after": 1}
