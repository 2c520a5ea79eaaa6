"""The end of a turn: its fiber finished, its message placed or extended, its stream closed, its
terminal error recorded, and what runs next started, in one transaction of a few plain statements.

Answers that arrived while the turn was finishing (tool results, approvals) are applied here too, and
the continuation they complete is started.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from django.db import connection, transaction

from recovery.lease.fibers import fiber_finish_on
from recovery.models import Fiber, Stream

from ..models import Conversation, Message, Submission
from ..types import UIMessage
from .completions import Ending, completion_record
from .interactions import buffered_updates_apply, continuation_due, foreign_updates_apply
from .quotas import ADD_TOKENS
from .selectors import json_column
from .snapshot import FiberSnapshot
from .submissions import submission_turn_finished, submissions_drain
from .turns import turn_send, turn_start_followup


@dataclass(frozen=True)
class TurnOutcome:
    status: str  # a Fiber.Status
    stream_status: str  # a Stream.Status
    message: UIMessage | None  # the assistant message to persist, if it has content
    terminal: str | None = None  # error text recorded for late reconnects
    # Tool outputs for calls of earlier messages (approved tools run by a continuation).
    foreign_updates: list[dict[str, Any]] = field(default_factory=list)
    # The run's output tokens, counted against its owner's day with its fiber's input tokens (quotas).
    output_tokens: int = 0


_FINISH_LOCK = (
    "SELECT tool_updates, continue_armed, owner, agent FROM {conversation} WHERE id = %s FOR UPDATE"
)


_MESSAGE_UPDATE = """
UPDATE {message} SET parts = %(parts)s::jsonb, metadata = %(metadata)s::jsonb, updated_at = now()
WHERE conversation_id = %(conversation)s AND message_id = %(id)s
RETURNING id
"""


# A turn's message goes right after the message its turn answered, even if newer messages were queued
# meanwhile (a second request accepted while the first streamed); at the end when that one is gone.
_MESSAGE_PLACE = """
WITH anchor AS (
    SELECT position FROM {message} WHERE conversation_id = %(conversation)s AND message_id = %(after)s
), shift AS (
    UPDATE {message} SET position = position + 1
    WHERE conversation_id = %(conversation)s AND position > (SELECT position FROM anchor)
    RETURNING 1
)
INSERT INTO {message} (conversation_id, message_id, role, parts, metadata, position, created_at, updated_at)
VALUES (
    %(conversation)s, %(id)s, %(role)s, %(parts)s::jsonb, %(metadata)s::jsonb,
    COALESCE(
        (SELECT position FROM anchor) + 1,
        (SELECT COALESCE(max(position), -1) + 1 FROM {message} WHERE conversation_id = %(conversation)s)
    ),
    now(), now()
)
"""


_STREAM_CLOSE = "UPDATE {stream} SET status = %s, completed_at = now() WHERE id = %s AND status = 'streaming'"


_TERMINAL = "UPDATE {conversation} SET last_terminal = %s::jsonb, updated_at = now() WHERE id = %s"


# What follows the turn: the next queued turn, and whether submissions wait on this conversation.
_AFTER = """
SELECT (SELECT id FROM {fiber} WHERE conversation_id = %(conversation)s AND status = 'pending'
        AND NOT EXISTS (SELECT 1 FROM {fiber} WHERE conversation_id = %(conversation)s AND status = 'running')
        ORDER BY created_at LIMIT 1),
    EXISTS (SELECT 1 FROM {submission} WHERE conversation_id = %(conversation)s
            AND status IN ('pending', 'running'))
"""


def _tables() -> dict[str, str]:

    return {
        "conversation": Conversation._meta.db_table,
        "message": Message._meta.db_table,
        "fiber": Fiber._meta.db_table,
        "stream": Stream._meta.db_table,
        "submission": Submission._meta.db_table,
    }


def turn_finish(
    *, fiber_id: Any, fencing: int, conversation_id: int, stream_id: Any, outcome: TurnOutcome
) -> None:
    """Persist the assistant message and close stream and fiber in one transaction, fenced.

    Every turn pays for this, so its common case is a handful of plain statements; answers buffered
    while it ran (and the continuation they complete) take the ORM path of `interactions_settle`.
    """
    tables = _tables()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_FINISH_LOCK.format(**tables), [conversation_id])
        tool_updates, continue_armed, owner, agent = cursor.fetchone()
        if owner:
            cursor.execute(
                ADD_TOKENS, {"principal": owner, "output": outcome.output_tokens, "fiber": fiber_id}
            )
        request_id, snapshot = fiber_finish_on(
            cursor, fiber_id=fiber_id, fencing=fencing, status=outcome.status, error=outcome.terminal or ""
        )
        turn = FiberSnapshot.from_json(snapshot).turn
        _completion_record(conversation_id, request_id, turn, outcome, agent)
        if outcome.message is not None:
            after = turn.latest_message_id if turn is not None else None
            _message_store(cursor, tables, conversation_id, outcome.message, after)
        if outcome.foreign_updates:
            foreign_updates_apply(conversation_id=conversation_id, updates=outcome.foreign_updates)
        terminal = {"requestId": request_id, "body": outcome.terminal} if outcome.terminal else None
        if json_column(tool_updates) or continue_armed:  # answers arrived meanwhile: apply them (ORM)
            conversation = Conversation.objects.get(pk=conversation_id)
            interactions_settle(conversation)
            conversation.last_terminal = terminal
            conversation.save(update_fields=["last_terminal", "tool_updates", "continue_armed", "updated_at"])
        else:
            cursor.execute(_TERMINAL.format(**tables), [json.dumps(terminal), conversation_id])
        if stream_id is not None:
            cursor.execute(_STREAM_CLOSE.format(**tables), [outcome.stream_status, stream_id])
        cursor.execute(_AFTER.format(**tables), {"conversation": conversation_id})
        pending, submissions = cursor.fetchone()
        root = turn.root_request_id if turn is not None else request_id
        transaction.on_commit(lambda: _turn_after(conversation_id, pending, submissions, root))


_ENDINGS: dict[str, str] = {
    Fiber.Status.COMPLETED: Ending.COMPLETED,
    Fiber.Status.CANCELLED: Ending.CANCELLED,
}


def _completion_record(
    conversation_id: int, request_id: str, turn: Any, outcome: TurnOutcome, agent: str
) -> None:
    """The turn (its chain) ends here: completed, recovered (a recovery's turn), cancelled or failed."""
    ending = _ENDINGS.get(outcome.status, str(Ending.FAILED))
    if ending == Ending.COMPLETED and turn is not None and turn.incident_id:
        ending = Ending.RECOVERED
    completion_record(
        conversation_id=conversation_id,
        request_id=turn.root_request_id if turn is not None else request_id,
        last_request_id=request_id,
        ending=ending,
        message_id=outcome.message["id"] if outcome.message is not None else None,
        error=outcome.terminal or "",
        agent=agent,
    )


def _message_store(
    cursor: Any, tables: dict[str, str], conversation_id: int, message: UIMessage, after: str | None
) -> None:
    params = {
        "conversation": conversation_id,
        "id": message["id"],
        "role": message["role"],
        "parts": json.dumps(message.get("parts", [])),
        "metadata": json.dumps(message["metadata"]) if message.get("metadata") is not None else None,
        "after": after,
    }
    cursor.execute(_MESSAGE_UPDATE.format(**tables), params)  # a continuation's: the message it extends
    if cursor.fetchone() is None:
        cursor.execute(_MESSAGE_PLACE.format(**tables), params)


def _turn_after(conversation_id: int, pending: Any, submissions: bool, root_request_id: str) -> None:
    """After a turn: start the next queued one; settle its submission and drain waiting ones."""
    if pending is not None:
        turn_send(pending)
    if submissions:
        submission_turn_finished(conversation_id=conversation_id, root_request_id=root_request_id)
        submissions_drain(conversation_id=conversation_id)


def interactions_settle(conversation: Conversation) -> None:
    """Apply answers that arrived while the turn finished, and start the continuation they complete.

    Call with the conversation locked; the caller saves `tool_updates` and `continue_armed`.
    """
    buffered_updates_apply(conversation)
    leaf = Message.objects.filter(conversation=conversation).order_by("-position").first()
    if leaf is not None and continuation_due(conversation, leaf):
        conversation.continue_armed = ""
        turn_start_followup(conversation=conversation, require_idle=False)
