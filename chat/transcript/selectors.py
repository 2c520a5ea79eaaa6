"""Reads: transcripts, active streams and turns."""

from __future__ import annotations

import json
from typing import Any

from django.db import connection
from django.db.models import Q

from recovery.models import Alarm, Fiber, Incident, Stream
from recovery.stream import stream_chunks

from ..models import Compaction, Conversation, Message
from .folding import MessageAccumulator, fold_bodies
from .snapshot import TurnSnapshot


def conversation_get(*, agent: str, name: str) -> Conversation | None:
    return Conversation.objects.filter(agent=agent, name=name).first()


_MESSAGES = (
    "SELECT message_id, role, parts, metadata FROM {message} WHERE conversation_id = %s ORDER BY position"
)
_COMPACTIONS = (
    "SELECT compaction_id, from_message_id, to_message_id, summary FROM {compaction}"
    " WHERE conversation_id = %s ORDER BY created_at"
)


def messages_list(*, conversation_id: int, raw: bool = False) -> list[dict[str, Any]]:
    """The transcript as UIMessages, in order; compacted ranges show as their summary unless `raw`.

    Read with plain statements: every turn reads its transcript at least twice.
    """
    with connection.cursor() as cursor:
        cursor.execute(_MESSAGES.format(message=Message._meta.db_table), [conversation_id])
        rows = [_ui_message(*row) for row in cursor.fetchall()]
        if raw:
            return rows
        cursor.execute(_COMPACTIONS.format(compaction=Compaction._meta.db_table), [conversation_id])
        overlays = [
            Compaction(compaction_id=c, from_message_id=f, to_message_id=t, summary=text)
            for c, f, t, text in cursor.fetchall()
        ]
    if not overlays:
        return rows
    index = {row["id"]: i for i, row in enumerate(rows)}
    spans = sorted(
        (index[o.from_message_id], index[o.to_message_id], o)
        for o in overlays
        if o.from_message_id in index and o.to_message_id in index
    )
    messages: list[dict[str, Any]] = []
    cursor_at = 0
    for start, end, overlay in spans:
        if start < cursor_at or end < start:
            continue  # superseded or malformed: the messages stay visible
        messages += rows[cursor_at:start]
        messages.append(overlay.as_ui_message())
        cursor_at = end + 1
    return messages + rows[cursor_at:]


def _ui_message(message_id: str, role: str, parts: Any, metadata: Any) -> dict[str, Any]:
    """A message row as its UIMessage (as Message.as_ui_message does)."""
    message: dict[str, Any] = {"id": message_id, "role": role, "parts": _json(parts)}
    if metadata is not None:
        decoded = _json(metadata)
        if decoded is not None:
            message["metadata"] = decoded
    return message


def _json(value: Any) -> Any:
    """A jsonb column read with a plain cursor (Django leaves its decoding to the model field)."""
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
    # Recovered and nothing followed: given up or declined (a terminal error), or nothing left to do.
    exhausted = Incident.objects.filter(
        conversation_id=conversation_id,
        recovery_root_request_id=root_request_id,
        status__in=[Incident.Status.EXHAUSTED, Incident.Status.FAILED],
    ).exists()
    terminal = Conversation.objects.values_list("last_terminal", flat=True).get(pk=conversation_id) or {}
    request_ids = set(chain.values_list("request_id", flat=True))
    return "error" if exhausted or terminal.get("requestId") in request_ids else "completed"
