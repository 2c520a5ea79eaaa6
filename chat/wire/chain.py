"""A turn as one stream of UI message chunks, across the recoveries that continued it (chat.wire.http).

A turn's answer may be streamed by several fibers: its own, cut off by a dead worker, then each recovery
continuation, all extending one assistant message. A client of the AI SDK's HTTP transport reads that
answer as one message: one `start` naming it, the chunks of every stream of the chain in order (a
continuation's own `start` left out), and the end only once the chain has ended. What an interrupted
stream leaves open (its text part, say) the continuation's chunks follow, as on the WebSocket.

Everything here is read from Postgres, which holds every chunk before it is published: a reader that
missed frames, or joins late, reads them here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from django.db.models import Q

from recovery.models import Fiber, Stream
from recovery.stream.buffer import stream_chunks

from ..models import Conversation, TurnCompletion
from ..transcript.completions import root_of
from ..transcript.selectors import active_stream, chain_outcome, pending_turn_request_id
from ..transcript.snapshot import TurnSnapshot
from ..turn.interrupted import recovering_flag_active
from .resume import is_start

# A read returns at most this many chunks; the caller reads again from where it stopped.
CHAIN_PAGE_CHUNKS = 200
FAILED_TEXT = "The turn failed."


@dataclass(frozen=True)
class Cursor:
    """Where a reader is in a chain: the last stream it read from, and that stream's last seq sent."""

    stream_id: Any = None
    seq: int = -1


@dataclass(frozen=True)
class ChainRead:
    bodies: list[str]  # the chunks' JSON texts, in order, ready to send
    cursor: Cursor
    streams: dict[str, Any]  # request id -> stream id, for every stream of the chain so far
    more: bool = False  # a page was full: read again from `cursor`
    outcome: str | None = None  # set once the chain has ended and every chunk of it was read
    error: str = ""  # the error text of an "error" outcome


def chain_streams(*, conversation_id: int, root_request_id: str) -> list[tuple[Any, str, bool]]:
    """(stream id, request id, is continuation) of every stream of a turn's chain, oldest first."""
    fibers = Fiber.objects.filter(conversation_id=conversation_id).filter(
        Q(request_id=root_request_id)
        | Q(**{TurnSnapshot.lookup("recovery_root_request_id"): root_request_id})
    )
    rows = Stream.objects.filter(conversation_id=conversation_id, fiber__in=fibers).order_by("created_at")
    return list(rows.values_list("pk", "request_id", "is_continuation"))


def chain_read(
    *, conversation_id: int, root_request_id: str, cursor: Cursor = Cursor(), limit: int = CHAIN_PAGE_CHUNKS
) -> ChainRead:
    """The chunks of a turn's chain stored after `cursor` (from the chain's first `start` for a new
    reader), and its outcome once it has ended and they were all read.

    The outcome is read before the chunks: a chain seen ended has all of its chunks stored."""
    outcome = chain_outcome(conversation_id=conversation_id, root_request_id=root_request_id)
    streams = chain_streams(conversation_id=conversation_id, root_request_id=root_request_id)
    ids = [pk for pk, _, _ in streams]
    first = ids.index(cursor.stream_id) if cursor.stream_id in ids else 0
    bodies: list[str] = []
    at = cursor
    for index in range(first, len(streams)):
        pk = streams[index][0]
        after = cursor.seq if pk == cursor.stream_id else -1
        for seq, body in stream_chunks(pk, after_seq=after, limit=limit - len(bodies)):
            at = Cursor(pk, seq)
            if index > 0 and is_start(seq, body):
                continue  # a continuation's own start: the message was started by the first stream
            bodies.append(body)
        if len(bodies) >= limit:
            return ChainRead(bodies, at, {rid: pk for pk, rid, _ in streams}, more=True)
        if at.stream_id != pk:
            at = Cursor(pk, -1)  # a stream with no chunks (yet): the next read starts in it
    known = {rid: pk for pk, rid, _ in streams}
    if outcome is None:
        return ChainRead(bodies, at, known)
    error = chain_error(conversation_id, root_request_id, set(known)) if outcome == "error" else ""
    return ChainRead(bodies, at, known, outcome=outcome, error=error)


def chain_error(conversation_id: int, root_request_id: str, request_ids: set[str]) -> str:
    """The text a failed turn ended with: the terminal message recovery sent, or the recorded error."""
    terminal = Conversation.objects.values_list("last_terminal", flat=True).get(pk=conversation_id)
    if isinstance(terminal, dict) and (terminal.get("requestId") in request_ids | {root_request_id}):
        return str(terminal.get("body") or FAILED_TEXT)
    completion = TurnCompletion.objects.filter(conversation_id=conversation_id, request_id=root_request_id)
    return completion.values_list("error", flat=True).first() or FAILED_TEXT


def rejoin_root(*, conversation_id: int) -> str | None:
    """The turn a rejoining client follows: the chain of the stream now streaming, or of the turn
    accepted and not started yet, or of the turn that recovery is continuing; None when there is none."""
    stream = active_stream(conversation_id=conversation_id)
    request_id = (
        stream.request_id if stream is not None else pending_turn_request_id(conversation_id=conversation_id)
    )
    if request_id is None:
        fiber = (
            Fiber.objects.filter(conversation_id=conversation_id, status=Fiber.Status.INTERRUPTED)
            .order_by("-created_at")
            .first()
        )
        request_id = fiber.request_id if fiber is not None else None
    if request_id is None:  # between recovery's attempts: the conversation shows "recovering"
        flag = Conversation.objects.values_list("recovering", flat=True).get(pk=conversation_id) or {}
        if recovering_flag_active(flag, now_ms=int(time.time() * 1000)) and flag.get("requestId"):
            request_id = str(flag["requestId"])
    if request_id is None:
        return None
    return root_request_id(conversation_id=conversation_id, request_id=request_id)


def root_request_id(*, conversation_id: int, request_id: str) -> str:
    """The chain root of a request: the turn a recovery continuation continues (itself otherwise)."""
    snapshot = (
        Fiber.objects.filter(conversation_id=conversation_id, request_id=request_id)
        .order_by("-created_at")
        .values_list("snapshot", flat=True)
        .first()
    )
    return root_of(request_id, snapshot)
