"""What accepting a turn costs the web process: the statements of `turn_accept`, counted (issue 37: an
accept runs on the consumers' database thread, and a burst of turns queues behind it)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from chat.models import Conversation
from chat.transcript.services import messages_append
from chat.transcript.turns import turn_accept
from chat.wire.protocol import ChatRequest
from recovery.models import Fiber

pytestmark = pytest.mark.django_db

# The statements of an accept of a new question in a conversation with history (the client echoing it),
# the savepoint and its release included: 16 when the stored ids and the edit check were each read twice.
MOST_STATEMENTS = 14


def text(message_id: str, role: str) -> dict[str, Any]:
    return {"id": message_id, "role": role, "parts": [{"type": "text", "text": message_id}]}


def test_an_accept_costs_a_bounded_number_of_statements() -> None:
    conversation = Conversation.objects.create(agent="assistant", name="cost")
    first = [text("u1", "user")]
    assert turn_accept(
        conversation_id=conversation.pk, request=ChatRequest("r1", first, "submit-message")
    ).fiber_id
    Fiber.objects.filter(conversation=conversation).update(status=Fiber.Status.COMPLETED)
    messages_append(conversation_id=conversation.pk, messages=[text("a1", "assistant")])  # its answer
    echo = [*first, text("a1", "assistant"), text("u2", "user")]
    with CaptureQueriesContext(connection) as queries:
        accepted = turn_accept(
            conversation_id=conversation.pk, request=ChatRequest("r2", echo, "submit-message")
        )
    assert accepted.fiber_id is not None
    statements = [q["sql"] for q in queries.captured_queries]
    assert len(statements) <= MOST_STATEMENTS, "\n".join(s[:120] for s in statements)
    # No message's parts are read but the edited one's (`_edit_of`, by its id): the latest message is
    # often a long answer, and accepting a question never needs it whole.
    parts_read = [
        sql
        for sql in statements
        if '"think_chat_message"."parts"' in sql.split(" FROM ")[0] and '"message_id" = ' not in sql
    ]
    assert parts_read == []
