"""Reads: transcripts, active streams and turns."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.db.models import Q

from recovery.lease.fibers import conversation_busy
from recovery.models import ACTIVE_STATUSES, Alarm, Fiber, Incident, Stream
from recovery.stream.buffer import stream_chunks

from ..models import Compaction, Conversation, Message
from ..types import UIMessage
from .folding import MessageAccumulator, fold_bodies
from .repair import pending_interaction
from .snapshot import TurnSnapshot

# Read on every connect and every new conversation: raw, as the ORM's compile of a one-row lookup costs
# about as much as the lookup (issue 37). A raw queryset still applies the fields' converters.
_BY_NAME = "SELECT * FROM {conversation} WHERE agent = %s AND name = %s"


def conversation_get(*, agent: str, name: str) -> Conversation | None:
    query = _BY_NAME.format(conversation=Conversation._meta.db_table)
    return next(iter(Conversation.objects.raw(query, [agent, name])), None)


_MESSAGES = (
    "SELECT message_id, role, parts, metadata, position FROM {message} WHERE conversation_id = %s{outside}"
    " ORDER BY position"
)
_SPANS = (
    "SELECT c.compaction_id, c.summary, f.position, t.position FROM {compaction} c"
    " JOIN {message} f ON f.conversation_id = c.conversation_id AND f.message_id = c.from_message_id"
    " JOIN {message} t ON t.conversation_id = c.conversation_id AND t.message_id = c.to_message_id"
    " WHERE c.conversation_id = %s ORDER BY c.created_at"
)


@dataclass(frozen=True)
class Span:
    """A compacted range of message positions and the summary shown in its place."""

    low: int
    high: int
    summary: UIMessage


def compacted_spans(conversation_id: int) -> list[Span]:
    """The conversation's compaction overlays as position ranges, in order; an overlay that overlaps an
    earlier one (superseded) or is malformed is ignored, and its messages stay visible."""
    tables = {"compaction": Compaction._meta.db_table, "message": Message._meta.db_table}
    with connection.cursor() as cursor:
        cursor.execute(_SPANS.format(**tables), [conversation_id])
        found = cursor.fetchall()
    spans: list[Span] = []
    reached = 0
    for low, high, _, compaction in sorted(
        (low, high, order, Compaction(compaction_id=c, summary=s))
        for order, (c, s, low, high) in enumerate(found)
    ):
        if low < reached or high < low:
            continue
        spans.append(Span(low, high, compaction.as_ui_message()))
        reached = high + 1
    return spans


def messages_list(*, conversation_id: int, raw: bool = False) -> list[UIMessage]:
    """The transcript as UIMessages, in order; compacted ranges show as their summary unless `raw`.

    Read with plain statements: every turn reads its transcript at least once. The messages a summary
    stands for are not read at all: after a compaction a turn loads the summary and what follows.
    """
    spans = [] if raw else compacted_spans(conversation_id)
    outside = "".join(f" AND position NOT BETWEEN {s.low:d} AND {s.high:d}" for s in spans)
    with connection.cursor() as cursor:
        sql = _MESSAGES.format(message=Message._meta.db_table, outside=outside)
        cursor.execute(sql, [conversation_id])
        rows = cursor.fetchall()
    messages: list[UIMessage] = []
    pending = iter(spans)
    span = next(pending, None)
    for message_id, role, parts, metadata, position in rows:
        while span is not None and span.low < position:  # each summary where its range was
            messages.append(span.summary)
            span = next(pending, None)
        messages.append(_ui_message(message_id, role, parts, metadata))
    while span is not None:
        messages.append(span.summary)
        span = next(pending, None)
    return messages


def interaction_pending(*, conversation_id: int, extra: list[UIMessage] | None = None) -> bool:
    """True while a human must act: an approval is requested or a client tool awaits its result.

    `extra` adds messages not stored yet (the partial of an interrupted turn).
    """
    conversation = Conversation.objects.only("last_client_tools").get(pk=conversation_id)
    tools = conversation.last_client_tools or []
    client_tools = {str(t.get("name")) for t in tools if isinstance(t, dict)}
    messages = messages_list(conversation_id=conversation_id)
    return pending_interaction([*messages, *(extra or [])], client_tools)


def conversation_stable(*, conversation_id: int) -> bool:
    """No turn of the conversation is queued or running, and no human is pending."""
    return not conversation_busy(conversation_id) and not interaction_pending(conversation_id=conversation_id)


def _ui_message(message_id: str, role: str, parts: Any, metadata: Any) -> UIMessage:
    """A message row as its UIMessage (as Message.as_ui_message does)."""
    message: UIMessage = {"id": message_id, "role": role, "parts": json_column(parts)}
    if metadata is not None:
        decoded = json_column(metadata)
        if decoded is not None:
            message["metadata"] = decoded
    return message


def json_column(value: Any) -> Any:
    """A json or jsonb column read with a plain cursor (Django leaves its decoding to the model field)."""
    return json.loads(value) if isinstance(value, str | bytes) else value


def active_stream(*, conversation_id: int) -> Stream | None:
    """The newest stream still marked streaming (live, or orphaned until recovery settles it)."""
    return (
        Stream.objects.filter(conversation_id=conversation_id, status=Stream.Status.STREAMING)
        .order_by("-created_at")
        .first()
    )


def stream_for_request(*, conversation_id: int, request_id: str) -> Stream | None:
    return (
        Stream.objects.filter(conversation_id=conversation_id, request_id=request_id)
        .order_by("-created_at")
        .first()
    )


_CONNECT = """
SELECT c.recovering,
    (SELECT s.request_id FROM {stream} s WHERE s.conversation_id = c.id AND s.status = %s
     ORDER BY s.created_at DESC LIMIT 1),
    (SELECT f.request_id FROM {fiber} f
     WHERE f.conversation_id = c.id AND f.status = ANY(%s)
         AND NOT EXISTS (SELECT 1 FROM {stream} s WHERE s.fiber_id = f.id)
     ORDER BY f.created_at DESC LIMIT 1),
    EXISTS (SELECT 1 FROM {message} m WHERE m.conversation_id = c.id)
FROM {conversation} c WHERE c.id = %s
"""


@dataclass(frozen=True)
class ConnectSummary:
    """What a connecting client is told first, in one statement: `active_stream`'s request id,
    `pending_turn_request_id`, the recovering flag, and whether there is a transcript at all."""

    recovering: dict[str, Any] | None
    active_request_id: str | None
    pending_request_id: str | None
    has_messages: bool


def connect_summary(*, conversation_id: int) -> ConnectSummary:
    sql = _CONNECT.format(
        stream=Stream._meta.db_table,
        fiber=Fiber._meta.db_table,
        message=Message._meta.db_table,
        conversation=Conversation._meta.db_table,
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [Stream.Status.STREAMING, list(ACTIVE_STATUSES), conversation_id])
        row = cursor.fetchone()
    if row is None:
        raise Conversation.DoesNotExist(f"no conversation {conversation_id}")
    recovering, active, pending, has_messages = row
    return ConnectSummary(json_column(recovering), active, pending, bool(has_messages))


def pending_turn_request_id(*, conversation_id: int) -> str | None:
    """The newest accepted turn that has not started streaming yet (the pre-stream window)."""
    fibers = Fiber.objects.filter(conversation_id=conversation_id).active().order_by("-created_at")
    for fiber in fibers:
        if not Stream.objects.filter(fiber=fiber).exists():
            return fiber.request_id
    return None


def stream_partial(stream: Stream) -> tuple[MessageAccumulator, int]:
    """The message a stored stream makes, and its last chunk's seq (-1 when it has none).

    A continuation's stream extends a stored message, so its chunks are folded onto that message as
    it is stored (the continuation writes it only when it finishes).
    """
    chunks = stream_chunks(stream.pk)
    base = None
    if stream.is_continuation:
        rows = Message.objects.filter(conversation_id=stream.conversation_id, message_id=stream.message_id)
        row = rows.first()
        base = row.as_ui_message() if row is not None else None
    partial = fold_bodies(stream.message_id, (body for _, body in chunks), extends=base)
    partial.message_id = stream.message_id  # the persisted id wins over anything a chunk said
    return partial, (chunks[-1][0] if chunks else -1)


FIBER_OUTCOMES: dict[str, str] = {
    Fiber.Status.COMPLETED: "completed",
    Fiber.Status.FAILED: "error",
    Fiber.Status.CANCELLED: "aborted",
}


def chain_outcome(*, conversation_id: int, root_request_id: str) -> str | None:
    """The outcome of a turn and the recoveries that continued it; None while any of it may still run."""
    chain = Fiber.objects.filter(conversation_id=conversation_id).filter(
        Q(request_id=root_request_id)
        | Q(**{TurnSnapshot.lookup("recovery_root_request_id"): root_request_id})
    )
    if chain.filter(
        status__in=[Fiber.Status.PENDING, Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED]
    ).exists():
        return None
    alarms = Alarm.objects.filter(conversation_id=conversation_id, payload__originalRequestId=root_request_id)
    if alarms.exists():  # a continue or a retry is scheduled: either keeps the chain open
        return None
    last = chain.order_by("-created_at").first()
    if last is None:
        return "skipped"
    if last.status in FIBER_OUTCOMES:
        return FIBER_OUTCOMES[last.status]
    # Recovered and nothing followed: stopped (aborted), given up or declined (a terminal error), or
    # nothing left to do.
    incidents = Incident.objects.filter(
        conversation_id=conversation_id, recovery_root_request_id=root_request_id
    )
    if incidents.filter(status=Incident.Status.CANCELLED).exists():
        return "aborted"
    exhausted = Incident.objects.filter(
        conversation_id=conversation_id,
        recovery_root_request_id=root_request_id,
        status__in=[Incident.Status.EXHAUSTED, Incident.Status.FAILED],
    ).exists()
    terminal = Conversation.objects.values_list("last_terminal", flat=True).get(pk=conversation_id) or {}
    request_ids = set(chain.values_list("request_id", flat=True))
    return "error" if exhausted or terminal.get("requestId") in request_ids else "completed"
