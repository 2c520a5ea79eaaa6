"""Server side of the resume handshake, as decisions read from Postgres.

Any web process can answer, because the active stream, the pre-stream turn and the terminal record
all live in the database.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from django.db import transaction

from recovery.models import Fiber, Stream
from recovery.stream.buffer import stream_chunks, stream_close, stream_last_seq

from ..models import Conversation, Message
from ..protocol import dumps, response_frame
from ..transcript.folding import message_chunks
from ..transcript.selectors import (
    active_stream,
    connect_summary,
    pending_turn_request_id,
    stream_for_request,
    stream_partial,
)
from ..transcript.services import message_upsert
from ..transcript.snapshot import FiberSnapshot
from ..transcript.window import Window, transcript_window
from ..turn.interrupted import recovering_flag_active
from ..types import Part, UIMessage
from .presence import connection_present


@dataclass(frozen=True)
class ConnectState:
    active_request_id: str | None
    pending_request_id: str | None
    window: Window | None  # the transcript's window (chat.transcript.window); None while a stream runs
    recovering: dict[str, Any] | None


def connect_state(*, conversation_id: int) -> ConnectState:
    """One statement (`connect_summary`), then the transcript's window when there is one and no stream
    runs (a new conversation's connect reads nothing more)."""
    summary = connect_summary(conversation_id=conversation_id)
    if summary.active_request_id is not None:
        return ConnectState(summary.active_request_id, None, None, None)
    fresh = recovering_flag_active(summary.recovering, now_ms=int(time.time() * 1000))
    window = transcript_window(conversation_id=conversation_id) if summary.has_messages else Window([], False)
    return ConnectState(None, summary.pending_request_id, window, summary.recovering if fresh else None)


@dataclass(frozen=True)
class ProbeAnswer:
    kind: str  # "resuming", "pending", "continuation-owned" or "idle"
    request_id: str | None = None


def _owned_by_another(stream: Stream, channel_name: str | None) -> bool:
    """A tool continuation whose owner (the connection that answered the tool) is still connected."""
    if not stream.is_continuation or stream.fiber_id is None or channel_name is None:
        return False

    stored = Fiber.objects.values_list("snapshot", flat=True).get(pk=stream.fiber_id)
    turn = FiberSnapshot.from_json(stored).turn
    owner = turn.owner_channel if turn is not None else None
    return isinstance(owner, str) and owner != channel_name and connection_present(owner)


def probe_answer(*, conversation_id: int, channel_name: str | None = None) -> ProbeAnswer:
    """What to answer to cf_agent_stream_resume_request (from the connection `channel_name`)."""
    stream = active_stream(conversation_id=conversation_id)
    if stream is not None:
        if _owned_by_another(stream, channel_name):
            return ProbeAnswer("continuation-owned", stream.request_id)
        return ProbeAnswer("resuming", stream.request_id)
    terminal = Conversation.objects.values_list("last_terminal", flat=True).get(pk=conversation_id)
    if isinstance(terminal, dict) and terminal.get("requestId"):
        return ProbeAnswer("resuming", str(terminal["requestId"]))
    pending = pending_turn_request_id(conversation_id=conversation_id)
    if pending is not None:
        return ProbeAnswer("pending", pending)
    # A turn may have opened its stream between the first look and the pending check (it is then
    # neither): look again, or a running turn would be answered with an authoritative "idle".
    stream = active_stream(conversation_id=conversation_id)
    if stream is not None:
        return ProbeAnswer("resuming", stream.request_id)
    # Between an interrupted stream's end and its continuation's start, recovery owns the turn:
    # the client waits (parked) rather than hearing "idle"; it is released if recovery ends without one.

    flag = Conversation.objects.values_list("recovering", flat=True).get(pk=conversation_id)
    if isinstance(flag, dict) and recovering_flag_active(flag, now_ms=int(time.time() * 1000)):
        return ProbeAnswer("pending", str(flag.get("requestId") or "") or None)
    return ProbeAnswer("idle")


# A replay reads and sends the stored chunks this many at a time: a long stream's replay holds one
# page in memory, and its first frames leave before the rest is read.
REPLAY_PAGE_CHUNKS = 200


@dataclass(frozen=True)
class Pages:
    """The stored chunks a replay still sends after its first page, up to the last one stored when
    the ACK was answered (what is stored later reaches the connection live)."""

    stream_id: Any
    request_id: str
    after_seq: int
    through_seq: int
    continuation: bool  # the frames' continuation flag
    skip_start: bool  # a continuation replayed whole: its own `start` is not sent


@dataclass(frozen=True)
class Replay:
    """The answer to an ACK: `frames`, then the `pages` read one at a time (`replay_page`), then
    `closing` (the end frame, or the frame that says the live tail follows)."""

    frames: list[str]
    last_seq: int  # highest chunk seq replayed (-1 when none)
    ignore: bool = False  # an ACK for a stream other than the active one
    messages: Window | None = None  # a finalised orphan changed the transcript: for all
    snapshot: Window | None = None  # the transcript, for the acking connection only
    live: bool = False  # the stream still runs: its live tail follows
    pages: Pages | None = None
    closing: tuple[str, ...] = ()

    def read_all(self) -> list[str]:
        """Every frame of the replay in order, its pages read now (a synchronous caller's view)."""
        frames, pages = list(self.frames), self.pages
        while pages is not None:
            page, pages = replay_page(pages)
            frames += page
        return [*frames, *self.closing]


def replay_page(pages: Pages) -> tuple[list[str], Pages | None]:
    """The frames of the next page of stored chunks, and what is left after it (None: done)."""
    chunks = stream_chunks(
        pages.stream_id, after_seq=pages.after_seq, through_seq=pages.through_seq, limit=REPLAY_PAGE_CHUNKS
    )
    frames = _chunk_frames(pages.request_id, chunks, pages.continuation, skip_start=pages.skip_start)
    if not chunks or chunks[-1][0] >= pages.through_seq:  # done, or the stream was cleared meanwhile
        return frames, None
    return frames, replace(pages, after_seq=chunks[-1][0])


def _orphaned(stream: Stream) -> bool:
    """Still marked streaming, but no turn runs it and recovery does not own it either."""
    live = [Fiber.Status.PENDING, Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED]
    return stream.fiber_id is None or not Fiber.objects.filter(pk=stream.fiber_id, status__in=live).exists()


def _finalize_orphan(stream: Stream) -> Replay:
    """Replay an orphaned stream, close it, and store the message its chunks make."""

    frames, last, pages = _replay_frames(stream, _extended_message(stream))  # before the message is stored
    with transaction.atomic():
        Conversation.objects.select_for_update().filter(pk=stream.conversation_id).first()
        partial, _ = stream_partial(stream)
        if partial.has_content:
            message_upsert(conversation_id=stream.conversation_id, message=partial.message())
        stream_close(stream_id=stream.pk, status=Stream.Status.COMPLETED)
    end = response_frame(stream.request_id, done=True, replay=True, seq=last + 1)
    messages = transcript_window(conversation_id=stream.conversation_id)
    return Replay(frames, last + 1, messages=messages, pages=pages, closing=(end,))


def _replay_frames(stream: Stream, base: UIMessage | None) -> tuple[list[str], int, Pages | None]:
    """Every stored chunk of a stream still running (or orphaned), for a client that ACKed it.

    A continuation's chunks extend a stored message that the client may not show the way the
    continuation's first frames found it (it reloaded, or reconnected, in the middle). So its replay
    is the whole message, `base` (`_extended_message`): that message as chunks under a `start` naming
    it, then the continuation's own chunks, none flagged as a continuation. Every client resets a
    message whose replayed `start` names it, so each shows the message once, whole, then follows the
    live tail in place.

    Only the first page of chunks is read here; when there are more, `Pages` says which are left
    (up to the last chunk stored now) and the highest seq returned is that last one.
    """
    chunks = stream_chunks(stream.pk, limit=REPLAY_PAGE_CHUNKS)
    last = chunks[-1][0] if chunks else -1
    rid = stream.request_id
    continuation, skip_start = (stream.is_continuation, False) if base is None else (False, True)
    frames = _chunk_frames(rid, chunks, continuation, skip_start=skip_start)
    if base is not None:
        frames = [response_frame(rid, dumps(chunk), replay=True) for chunk in message_chunks(base)] + frames
    pages = None
    if len(chunks) == REPLAY_PAGE_CHUNKS and (through := stream_last_seq(stream.pk)) > last:
        pages, last = Pages(stream.pk, rid, last, through, continuation, skip_start), through
    return frames, last, pages


def _chunk_frames(
    request_id: str, chunks: list[tuple[int, str]], continuation: bool, *, skip_start: bool
) -> list[str]:
    return [
        response_frame(request_id, body, replay=True, seq=seq, continuation=continuation)
        for seq, body in chunks
        if not (skip_start and is_start(seq, body))
    ]


def _extended_message(stream: Stream) -> UIMessage | None:
    """The stored message a continuation's replay shows whole; None to replay it as a continuation.

    ai@7 (the published client's resume path) carries on the last assistant message in place when it
    holds a part this continuation settles: an approved call, a call whose input was still streaming,
    a provider-executed call. Such a message is replayed as a continuation, appended where the client
    already shows it; replayed whole, its parts would show twice until the turn's end.
    """
    if not stream.is_continuation:
        return None
    row = Message.objects.filter(conversation_id=stream.conversation_id, message_id=stream.message_id).first()
    if row is None or any(_continued_in_place(part) for part in row.parts):
        return None
    return row.as_ui_message()


def _continued_in_place(part: Part) -> bool:
    state = part.get("state")
    return state in ("approval-responded", "input-streaming") or (
        state == "input-available" and bool(part.get("providerExecuted"))
    )


def is_start(seq: int, body: str) -> bool:
    """A stream's own `start` chunk (its first), not a `start-step`."""
    return seq == 0 and body.startswith('{"type":"start"') and not body.startswith('{"type":"start-')


def _finished_replay(stream: Stream | None) -> tuple[list[str], int, Pages | None]:
    """The chunks of a finished stream, for a client that ACKed it late.

    A finished continuation's chunks are already in the message it extended (get-messages and the
    transcript snapshot that follows show them), and a client appends a continuation's chunks to the
    last assistant message: replaying them would show them twice. So they are not replayed; the
    snapshot after the end frame brings the client up to date.
    """
    if stream is None:
        return [], -1, None
    if stream.is_continuation:
        return [], stream_last_seq(stream.pk), None
    return _replay_frames(stream, _extended_message(stream))


def _recorded_error(conversation_id: int, request_id: str) -> str | None:
    """The error text recorded for `request_id` when its turn failed (the conversation's terminal)."""
    terminal = Conversation.objects.values_list("last_terminal", flat=True).get(pk=conversation_id)
    if isinstance(terminal, dict) and terminal.get("requestId") == request_id:
        return str(terminal.get("body", ""))
    return None


def ack_replay(*, conversation_id: int, request_id: str) -> Replay:
    """The frames answering cf_agent_stream_resume_ack for request_id."""
    active = active_stream(conversation_id=conversation_id)
    if active is not None and active.request_id != request_id:
        return Replay([], -1, ignore=True)
    if active is not None and _orphaned(active):
        return _finalize_orphan(active)
    if active is not None:
        # The turn may end (message stored, stream closed: one transaction) while this reads. So the
        # message is read first, then the stream again: still running, the message is as the turn
        # found it, without the chunks read next (all of them, if it ends meanwhile). Ended, the
        # message may hold them already: the stream is answered as a finished one.
        base = _extended_message(active)
        if Stream.objects.filter(pk=active.pk, status=Stream.Status.STREAMING).exists():
            frames, last, pages = _replay_frames(active, base)
            continuation = active.is_continuation and base is None
            tail = response_frame(request_id, replay=True, replay_complete=True, continuation=continuation)
            return Replay(frames, last, live=True, pages=pages, closing=(tail,))
    error = _recorded_error(conversation_id, request_id)
    stream = stream_for_request(conversation_id=conversation_id, request_id=request_id)
    frames, last, pages = _finished_replay(stream)
    snapshot = transcript_window(conversation_id=conversation_id)
    if error is not None:
        end = response_frame(request_id, error, done=True, error=True, seq=last + 1)
        return Replay(frames, last + 1, snapshot=snapshot, pages=pages, closing=(end,))
    continuation = stream.is_continuation if stream is not None else False
    outcome = _stored_outcome(stream) if stream is not None else None
    end = response_frame(
        request_id, done=True, replay=True, continuation=continuation, seq=last + 1, outcome=outcome
    )
    return Replay(frames, last + 1, snapshot=snapshot, pages=pages, closing=(end,))


@dataclass(frozen=True)
class Tail:
    """What the store holds of a stream past the last chunk a connection sent (chat.wire.silence)."""

    frames: list[tuple[int, str]]  # (seq, frame) of the chunks stored after it
    end: tuple[int, str] | None = None  # (seq, frame): the stream has ended
    snapshot: Window | None = None  # the transcript, after the end
    gone: bool = False  # no such stream any more (the conversation was cleared)


# The outcome an end frame read from the store carries, from the status of the stream's fiber.
_OUTCOMES: dict[str, str] = {
    Fiber.Status.COMPLETED: "completed",
    Fiber.Status.CANCELLED: "aborted",
    Fiber.Status.FAILED: "error",
    Fiber.Status.INTERRUPTED: "recovering",
    Fiber.Status.RECOVERED: "recovering",
}


def _stored_outcome(stream: Stream) -> str | None:
    """How a finished stream's turn ended, from its fiber's status (None when it has no fiber)."""
    fibers = Fiber.objects.filter(pk=stream.fiber_id) if stream.fiber_id is not None else Fiber.objects.none()
    status = fibers.values_list("status", flat=True).first()
    return _OUTCOMES.get(status) if status is not None else None


def stream_tail(*, conversation_id: int, request_id: str, after_seq: int) -> Tail:
    """The chunks of a followed stream stored after `after_seq`, then its end once it has ended.

    The stream's status is read before its chunks: a stream seen ended has all of them stored. Its
    end frame is built from the store as the live one was (seq after the last stored chunk, the
    recorded error of a failed turn); its `outcome` is told by the fiber's status.
    """
    stream = stream_for_request(conversation_id=conversation_id, request_id=request_id)
    if stream is None:
        return Tail([], gone=True)
    chunks = stream_chunks(stream.pk, after_seq=after_seq)
    continuation = stream.is_continuation
    frames = [
        (seq, response_frame(request_id, body, seq=seq, continuation=continuation)) for seq, body in chunks
    ]
    if stream.status == Stream.Status.STREAMING:
        return Tail(frames)
    seq = (chunks[-1][0] if chunks else stream_last_seq(stream.pk)) + 1
    error = _recorded_error(conversation_id, request_id)
    if error is not None:
        end = response_frame(
            request_id, error, done=True, error=True, continuation=continuation, seq=seq, outcome="error"
        )
    else:
        outcome = _stored_outcome(stream)
        end = response_frame(request_id, done=True, continuation=continuation, seq=seq, outcome=outcome)
    return Tail(frames, (seq, end), transcript_window(conversation_id=conversation_id))
