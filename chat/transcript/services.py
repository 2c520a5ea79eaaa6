"""Writes: conversations, persisting messages, finishing turns, clearing conversations (accepting
turns is chat.transcript.turns).

Every write that clients must hear about is followed by a broadcast after its transaction commits.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Max
from django.utils import timezone

from recovery.exceptions import LeaseLost
from recovery.lease.fibers import fibers_fence_out
from recovery.models import Fiber, Stream
from recovery.process.rows import prepared, row_insert

from ..models import Compaction, Conversation, Message
from ..types import UIMessage
from .selectors import conversation_get

logger = logging.getLogger(__name__)


def conversation_get_or_create(*, agent: str, name: str, owner: str = "") -> Conversation:
    """The conversation (agent, name); a new one belongs to `owner` (an existing one keeps its owner)."""
    found = conversation_get(agent=agent, name=name)
    if found is None:
        found = conversation_insert(agent=agent, name=name, owner=owner)
    # None again: another connection created it between the read and the insert.
    return found or Conversation.objects.get(agent=agent, name=name)


def conversation_insert(*, agent: str, name: str, owner: str) -> Conversation | None:
    """A new conversation (agent, name) of `owner`, in one statement (recovery.process.rows: the ORM's
    get_or_create was four, issue 37); None when it exists already."""
    conversation = Conversation(agent=agent, name=name, owner=owner)
    created = row_insert(conversation, conflict="ON CONFLICT (agent, name) DO NOTHING")
    return conversation if created else None


def conversation_claim(*, conversation_id: int, owner: str) -> bool:
    """Give an unowned conversation to `owner`; True when it is (now or already) theirs."""
    Conversation.objects.filter(pk=conversation_id, owner="").update(owner=owner)
    return Conversation.objects.filter(pk=conversation_id, owner=owner).exists()


_LOCKED = "SELECT * FROM {conversation} WHERE id = %s FOR UPDATE"


def conversation_lock(conversation_id: int) -> Conversation:
    """The conversation, its row locked until the transaction ends (raw, as conversation_get)."""
    query = _LOCKED.format(conversation=Conversation._meta.db_table)
    for conversation in Conversation.objects.raw(query, [conversation_id]):
        return conversation
    raise Conversation.DoesNotExist(f"no conversation {conversation_id}")


def _next_position(conversation_id: int) -> int:
    current = Message.objects.filter(conversation_id=conversation_id).aggregate(m=Max("position"))["m"]
    return 0 if current is None else current + 1


def message_upsert(*, conversation_id: int, message: UIMessage) -> Message:
    """Store a UIMessage: replace the one with this id, or append it. Call with the conversation locked."""
    existing = Message.objects.filter(conversation_id=conversation_id, message_id=message["id"]).first()
    if existing is not None:
        existing.parts = message.get("parts", [])
        existing.metadata = message.get("metadata")
        existing.save(update_fields=["parts", "metadata", "updated_at"])
        return existing
    return _message_create(conversation_id, message, _next_position(conversation_id))


def messages_append(*, conversation_id: int, messages: list[UIMessage], first: int | None = None) -> None:
    """Append new UIMessages (ids the conversation does not have) in one insert, after the last one
    (`first`: the next position, when the caller read the last one under the same lock). Call with the
    conversation locked. Raw, with each JSON value prepared by its field as the ORM would (issue 37:
    `bulk_create` cost more than its statement)."""
    if not messages:
        return
    first = _next_position(conversation_id) if first is None else first
    rows, params = [], list[Any]()
    for offset, message in enumerate(messages):
        rows.append("(%s, %s, %s, %s, %s, %s, now(), now())")
        params += [
            conversation_id,
            message["id"],
            message["role"],
            prepared(Message, "parts", message.get("parts", [])),
            prepared(Message, "metadata", message.get("metadata")),
            first + offset,
        ]
    with connection.cursor() as cursor:
        cursor.execute(_APPEND.format(message=Message._meta.db_table, rows=", ".join(rows)), params)


_APPEND = (
    "INSERT INTO {message} (conversation_id, message_id, role, parts, metadata, position, created_at,"
    " updated_at) VALUES {rows}"
)


def conversation_request_save(*, conversation_id: int, last_body: Any, last_client_tools: Any) -> None:
    """What an accepted request leaves on its conversation for the turn and its continuations (Think's
    lastBody and lastClientTools), its last terminal error cleared. One raw statement; call with the
    conversation locked."""
    body = prepared(Conversation, "last_body", last_body)
    tools = prepared(Conversation, "last_client_tools", last_client_tools)
    query = _REQUEST_SAVE.format(conversation=Conversation._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(query, [body, tools, conversation_id])


_REQUEST_SAVE = (
    "UPDATE {conversation} SET last_body = %s, last_client_tools = %s, last_terminal = NULL,"
    " updated_at = now() WHERE id = %s"
)


def _message_create(conversation_id: int, message: UIMessage, position: int) -> Message:
    return Message.objects.create(
        conversation_id=conversation_id,
        message_id=message["id"],
        role=message["role"],
        parts=message.get("parts", []),
        metadata=message.get("metadata"),
        position=position,
    )


def message_place(*, conversation_id: int, message: UIMessage, after_message_id: str | None) -> Message:
    """Store a turn's message right after the message its turn answered, even if newer messages were
    queued meanwhile (a second request accepted while the first streamed). Call with the lock held."""
    known = Message.objects.filter(conversation_id=conversation_id, message_id=message["id"]).exists()
    anchor = (
        Message.objects.filter(conversation_id=conversation_id, message_id=after_message_id).first()
        if after_message_id and not known
        else None
    )
    if anchor is None:
        return message_upsert(conversation_id=conversation_id, message=message)
    later = Message.objects.filter(conversation_id=conversation_id, position__gt=anchor.position)
    later.update(position=F("position") + 1)
    return _message_create(conversation_id, message, anchor.position + 1)


def transcript_repair_save(
    *, fiber_id: Any, fencing: int, conversation_id: int, messages: list[UIMessage]
) -> None:
    """Store repaired messages, only while the repairing turn still holds its fiber."""
    with transaction.atomic():
        conversation_lock(conversation_id)
        if not Fiber.objects.filter(pk=fiber_id, fencing=fencing, status=Fiber.Status.RUNNING).exists():
            raise LeaseLost(f"fiber {fiber_id} fencing {fencing}")
        for message in messages:
            Message.objects.filter(conversation_id=conversation_id, message_id=message["id"]).update(
                parts=message.get("parts", []), updated_at=timezone.now()
            )


def conversation_clear(*, conversation_id: int) -> None:
    """Delete the transcript, stream buffers and request context; running turns are fenced out and
    open submissions skipped."""
    from .completions import Ending, completion_record, root_of
    from .submissions import submissions_skip_all

    with transaction.atomic():
        conversation = conversation_lock(conversation_id)
        active = list(
            Fiber.objects.filter(conversation_id=conversation_id)
            .active()
            .values_list("request_id", "snapshot")
        )
        fibers_fence_out(conversation_id=conversation_id)
        for request_id, snapshot in active:  # their turns end here, with no answer left to read
            completion_record(
                conversation_id=conversation_id,
                request_id=root_of(request_id, snapshot),
                last_request_id=request_id,
                ending=Ending.CANCELLED,
            )
        submissions_skip_all(conversation_id=conversation_id)
        Message.objects.filter(conversation=conversation).delete()
        Compaction.objects.filter(conversation=conversation).delete()
        Stream.objects.filter(conversation=conversation).delete()
        conversation.last_body = None
        conversation.last_client_tools = None
        conversation.last_terminal = None
        conversation.recovering = None
        conversation.tool_updates = []
        conversation.continue_armed = ""
        conversation.save(
            update_fields=[
                "last_body",
                "last_client_tools",
                "last_terminal",
                "recovering",
                "tool_updates",
                "continue_armed",
                "updated_at",
            ]
        )
