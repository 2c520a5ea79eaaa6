"""The transcript a client sees: its latest messages within a byte budget, older ones a page at a time.

A conversation may grow without bound; a WebSocket message may not (daphne refuses to send one over
1 MiB and closes the socket with 1011). So every transcript a client is sent (the connect frame, the
broadcasts after a turn, `get-messages`) is a window: the newest messages whose JSON fits
THINK["TRANSCRIPT_WINDOW_BYTES"], whole messages only, with `earlier` saying whether older ones exist
(`get-messages?before=<id>` pages back). The published hook echoes what it holds in every chat request,
so the echo is bounded too; the server keeps every message it has whatever the echo leaves out
(chat.transcript.turns), and the model reads the whole stored history.

Read newest first, a page of rows at a time, so a window costs what it holds, not the history's length.
A compaction's summary stands in for its range, as in messages_list.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from django.db import connection

from recovery.stream.encoding import dumps

from ..conf import think_setting
from ..models import Message
from ..protocol import chat_messages_frame
from ..types import Part, UIMessage
from .branches import annotate
from .compaction import real_message_id
from .selectors import _ui_message, compacted_spans

PAGE_ROWS = 200
MAX_PAGE_MESSAGES = 1000  # the most a get-messages page returns, whatever `limit` asks
TRUNCATED_KEY = "thinkTruncated"  # metadata of a message cut for display: {"bytes": its full size}
NOTE_BYTES = 400  # room kept for the note that says a message was cut

_ROWS_BEFORE = (
    "SELECT message_id, role, parts, metadata, position FROM {message}"
    " WHERE conversation_id = %s AND position > %s AND position < %s ORDER BY position DESC LIMIT %s"
)


@dataclass(frozen=True)
class Window:
    messages: list[UIMessage]  # oldest first
    earlier: bool  # older messages exist before the first


def message_bytes(message: UIMessage | Part) -> int:
    """The size of a message (or part) as the transcript frame carries it (compact JSON, UTF-8)."""
    return len(dumps(message).encode())


def _newest_first(conversation_id: int, below: int | None) -> Iterator[UIMessage]:
    """The transcript as clients see it, newest first, from just below position `below` (None: the end)."""
    spans = sorted(compacted_spans(conversation_id), key=lambda s: s.low, reverse=True)
    upper = below if below is not None else 2**31
    table = Message._meta.db_table
    while True:
        span = next((s for s in spans if s.low < upper), None)
        floor = span.high if span is not None else -1
        with connection.cursor() as cursor:
            cursor.execute(_ROWS_BEFORE.format(message=table), [conversation_id, floor, upper, PAGE_ROWS])
            rows = cursor.fetchall()
        for message_id, role, parts, metadata, position in rows:
            yield _ui_message(message_id, role, parts, metadata)
            upper = position
        if len(rows) == PAGE_ROWS:
            continue
        if span is None:
            return
        yield span.summary
        upper = span.low


def _position_of(conversation_id: int, message_id: str) -> int | None:
    """Where paging back from `message_id` starts; a summary's id stands for the start of its range."""
    real = real_message_id(conversation_id, message_id, "from")
    if real is None:
        return None
    rows = Message.objects.filter(conversation_id=conversation_id, message_id=real)
    return rows.values_list("position", flat=True).first()


def transcript_window(
    *,
    conversation_id: int,
    before: str | None = None,
    limit: int | None = None,
    budget: int | None = None,
) -> Window:
    """The newest messages (before message `before`, when given) within `budget` bytes of JSON
    (THINK["TRANSCRIPT_WINDOW_BYTES"]) and `limit` messages. Whole messages only; the newest one is
    always there, cut for display (truncated_for_display) if alone it is over the budget. An unknown
    `before` gives an empty window."""
    budget = budget if budget is not None else think_setting("TRANSCRIPT_WINDOW_BYTES")
    below = None
    if before is not None:
        below = _position_of(conversation_id, before)
        if below is None:
            return Window([], False)
    taken: list[UIMessage] = []
    used = 0
    earlier = False
    for message in _newest_first(conversation_id, below):
        size = message_bytes(message)
        if taken and (used + size > budget or (limit is not None and len(taken) >= limit)):
            earlier = True
            break
        if not taken and size > budget:
            message = truncated_for_display(message, budget)
            size = message_bytes(message)
        taken.append(message)
        used += size
    taken.reverse()
    return Window(annotate(conversation_id, taken, starts_at_beginning=not earlier), earlier)


def transcript_frame(*, conversation_id: int) -> str:
    """The `cf_agent_chat_messages` frame of a conversation's window."""
    window = transcript_window(conversation_id=conversation_id)
    return chat_messages_frame(window.messages, earlier=window.earlier)


def truncated_for_display(message: UIMessage, budget: int) -> UIMessage:
    """A copy of a message over `budget` bytes that fits in it, for the screen: its parts while they fit,
    the text of the first that does not cut short, then a text part saying so; metadata
    `thinkTruncated: {"bytes": <full size>}` marks it. The stored message stays whole (echoes of known
    messages never change it), and the model reads it whole."""
    size = message_bytes(message)
    note = {
        "type": "text",
        "text": f"\n\n[Shown cut short: this message is {size:,} bytes; the whole of it is kept.]",
    }
    metadata = {**(message.get("metadata") or {}), TRUNCATED_KEY: {"bytes": size}}
    shown: UIMessage = {"id": message["id"], "role": message["role"], "parts": [], "metadata": metadata}
    room = budget - message_bytes({**shown, "parts": [note]}) - NOTE_BYTES
    for part in message.get("parts") or []:
        cost = message_bytes(part) + 1
        if cost <= room:
            shown["parts"].append(part)
            room -= cost
            continue
        text = part.get("text") if isinstance(part, dict) else None
        if isinstance(text, str) and room > 0:
            overhead = cost - len(json.dumps(text, ensure_ascii=False).encode())  # the part without its text
            cut = _utf8_prefix(text, room - overhead - 16)
            if cut:
                shown["parts"].append({**part, "text": cut})
        break
    shown["parts"].append(note)
    return shown


def _utf8_prefix(text: str, limit: int) -> str:
    """The longest prefix of `text` whose JSON string fits in `limit` bytes (escapes counted)."""
    if limit <= 0:
        return ""
    low, high = 0, min(len(text), limit)
    while low < high:  # JSON escapes can make a prefix longer than its characters: search
        middle = (low + high + 1) // 2
        if len(json.dumps(text[:middle], ensure_ascii=False).encode()) <= limit:
            low = middle
        else:
            high = middle - 1
    return text[:low]
