"""What accepting a turn and connecting cost the web process: the statements of `turn_accept`, with what
runs when its transaction commits, and of `connect_state` (issue 37: a burst of 500 must not queue behind
each other's round trips)."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.test.utils import CaptureQueriesContext

from chat.conf import DEFAULTS
from chat.models import Conversation
from chat.protocol import ChatRequest
from chat.transcript.services import messages_append
from chat.transcript.snapshot import FiberSnapshot
from chat.transcript.turns import turn_accept
from chat.wire.resume import connect_state
from recovery.models import Fiber, Stream

pytestmark = pytest.mark.django_db

# An accept of a new question in a conversation with history (the client echoing it), savepoint and
# release included: the lock, one read of what the accept needs under it (the conversation's turns, the
# request's stored ids, the last position), the message, the conversation, the fiber. It was 16, then
# 14, plus 2 after the commit (is another turn running? which pending one is first?), each read alone.
MOST_STATEMENTS = 7
# A principal's turn under the default limits adds their lock, one read of what the limits count (the
# day's tokens, their turns queued or running and those started in the last minute: it was three) and
# the day's tally.
PRINCIPAL_STATEMENTS = 3

LIMITS = (
    "PRINCIPAL_MAX_ACTIVE_TURNS",
    "PRINCIPAL_TURNS_PER_MINUTE",
    "PRINCIPAL_TOKENS_PER_DAY",
    "PRINCIPAL_OUTPUT_TOKENS_PER_DAY",
)


def text(message_id: str, role: str) -> dict[str, Any]:
    return {"id": message_id, "role": role, "parts": [{"type": "text", "text": message_id}]}


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import chat.transcript.turns

    turns: list[Any] = []
    monkeypatch.setattr(chat.transcript.turns, "turn_send", turns.append)
    return turns


@pytest.mark.parametrize("owner", ["", "user:1"])
def test_an_accept_costs_a_bounded_number_of_statements(
    owner: str, sent: list[Any], settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.THINK = {**django_settings.THINK, **{key: DEFAULTS[key] for key in LIMITS}}
    conversation = Conversation.objects.create(agent="assistant", name="cost", owner=owner)
    first = [text("u1", "user")]
    with django_capture_on_commit_callbacks(execute=True):
        turn_accept(conversation_id=conversation.pk, request=ChatRequest("r1", first, "submit-message"))
    Fiber.objects.filter(conversation=conversation).update(status=Fiber.Status.COMPLETED)
    messages_append(conversation_id=conversation.pk, messages=[text("a1", "assistant")])  # its answer
    echo = [*first, text("a1", "assistant"), text("u2", "user")]
    with CaptureQueriesContext(connection) as queries, django_capture_on_commit_callbacks(execute=True):
        accepted = turn_accept(
            conversation_id=conversation.pk, request=ChatRequest("r2", echo, "submit-message")
        )
    assert accepted.fiber_id is not None and sent[-1] == accepted.fiber_id, "sent to the workers"
    statements = [q["sql"] for q in queries.captured_queries]
    most = MOST_STATEMENTS + (PRINCIPAL_STATEMENTS if owner else 0)
    assert len(statements) <= most, "\n".join(s[:120] for s in statements)
    # No message's parts are read but the edited one's (`_edit_of`, by its id): the latest message is
    # often a long answer, and accepting a question never needs it whole.
    parts_read = [
        sql
        for sql in statements
        if '"think_chat_message"."parts"' in sql.split(" FROM ")[0] and '"message_id" = ' not in sql
    ]
    assert parts_read == []
    turn = FiberSnapshot.from_json(Fiber.objects.get(pk=accepted.fiber_id).snapshot).turn
    assert turn is not None
    latest = (turn.latest_message_id, turn.latest_message_role, turn.latest_user_message_id)
    assert latest == ("u2", "user", "u2"), "the snapshot names the question it answers, not read back"


def test_a_turn_behind_another_is_sent_only_when_it_is_next(
    sent: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    """Only an accept that found nothing queued or running sends its turn straight away; one behind
    another waits for it (the running turn's end sends the next)."""
    conversation = Conversation.objects.create(agent="assistant", name="behind")
    first = [text("u1", "user")]
    with django_capture_on_commit_callbacks(execute=True):
        one = turn_accept(conversation_id=conversation.pk, request=ChatRequest("r1", first, "submit-message"))
    Fiber.objects.filter(pk=one.fiber_id).update(status=Fiber.Status.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        two = turn_accept(
            conversation_id=conversation.pk,
            request=ChatRequest("r2", [*first, text("u2", "user")], "submit-message"),
        )
    assert two.ahead == 1
    assert sent == [one.fiber_id], "the second waits for the first"
    again = turn_accept(
        conversation_id=conversation.pk,
        request=ChatRequest("r2", [*first, text("u2", "user")], "submit-message"),
    )
    assert again.duplicate and again.fiber_id == two.fiber_id, "the same request is the same turn"


def test_a_connect_reads_one_statement_then_the_window_only_when_there_is_a_transcript() -> None:
    """`connect_state`: one statement for what a connecting client is told first (active stream,
    pending turn, recovering flag, whether there are messages); the window's reads only when there is
    a transcript to show (it was six statements for a new conversation)."""
    conversation = Conversation.objects.create(agent="assistant", name="connect")
    with CaptureQueriesContext(connection) as queries:
        state = connect_state(conversation_id=conversation.pk)
    assert len(queries.captured_queries) == 1
    assert state.window is not None and state.window.messages == [] and state.pending_request_id is None
    messages_append(conversation_id=conversation.pk, messages=[text("u1", "user")])
    fiber = Fiber.objects.create(conversation=conversation, request_id="r1")
    with CaptureQueriesContext(connection) as queries:
        state = connect_state(conversation_id=conversation.pk)
    assert len(queries.captured_queries) <= 4, "the summary, the window's spans and rows, its branches"
    assert state.window is not None and [m["id"] for m in state.window.messages] == ["u1"]
    assert state.pending_request_id == "r1"
    Stream.objects.create(conversation=conversation, fiber=fiber, request_id="r1", message_id="a1")
    with CaptureQueriesContext(connection) as queries:
        state = connect_state(conversation_id=conversation.pk)
    assert len(queries.captured_queries) == 1
    assert (state.active_request_id, state.window) == ("r1", None)


def test_an_accept_stores_the_request_as_the_orm_would(
    sent: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    """The message insert and the conversation's update are raw statements: the JSON values round-trip
    (nested, unicode, a metadata of null), the request's body replaces the last one, its client tools
    are kept when the next request sends none, and the last terminal error is cleared."""
    conversation = Conversation.objects.create(
        agent="assistant", name="stored", last_terminal={"requestId": "r0", "body": "failed"}
    )
    tools = [{"name": "ask", "description": "ask the user", "parameters": {"type": "object"}}]
    first = {**text("u1", "user"), "metadata": {"at": "ünïcode ✓", "n": [1, 2.5, None, True]}}
    with django_capture_on_commit_callbacks(execute=True):
        turn_accept(
            conversation_id=conversation.pk,
            request=ChatRequest("r1", [first], "submit-message", extra={"mode": "a"}, client_tools=tools),
        )
    Fiber.objects.filter(conversation=conversation).update(status=Fiber.Status.COMPLETED)
    stored = Conversation.objects.get(pk=conversation.pk)
    assert (stored.last_body, stored.last_client_tools, stored.last_terminal) == ({"mode": "a"}, tools, None)
    assert stored.updated_at > conversation.updated_at
    second = text("u2", "user")
    with django_capture_on_commit_callbacks(execute=True):
        turn_accept(
            conversation_id=conversation.pk, request=ChatRequest("r2", [first, second], "submit-message")
        )
    stored = Conversation.objects.get(pk=conversation.pk)
    assert (stored.last_body, stored.last_client_tools) == (None, tools), "no tools sent: the last kept"
    rows = list(
        stored.messages.order_by("position").values("message_id", "role", "parts", "metadata", "position")
    )
    assert rows == [
        {
            "message_id": "u1",
            "role": "user",
            "parts": first["parts"],
            "metadata": first["metadata"],
            "position": 0,
        },
        {"message_id": "u2", "role": "user", "parts": second["parts"], "metadata": None, "position": 1},
    ]
    assert stored.messages.filter(metadata__isnull=True).count() == 1, "a null metadata is SQL NULL"
