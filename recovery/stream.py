"""The resumable stream: chunk buffering, flush policy, sequence numbers, progress credit and replay.

Every chunk gets a per-stream sequence number. Chunks are buffered and written as one segment row per
flush, in one statement that also renews the fiber's lease, credits progress and checks the fencing
number, so the hot path costs one round trip per batch and a fenced-out worker writes nothing.
Frames are published only after their segment is committed, so a client can always re-read what it saw.

A turn that can reattach to its provider's stored generation (`Think.model_reattach`) gives some
chunks a provider cursor (response id and event sequence number); the segment write records the
batch's last cursor in the fiber snapshot in the same statement, so the stored cursor never runs
ahead of, nor lags behind, the stored chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from chat.conf import think_setting
from chat.models import Conversation
from chat.protocol import chunk_frame, dumps, encode_chunk

from . import metrics
from .fibers import LeaseLost, lease_ttl
from .models import Fiber, Segment, Stream
from .runtime import db

logger = logging.getLogger(__name__)

MILESTONE_CHUNKS = frozenset(
    {
        "text-start",
        "reasoning-start",
        "tool-input-available",
        "tool-output-available",
        "tool-output-error",
        "tool-output-denied",
        "tool-approval-request",
    }
)
DELTA_CHUNKS = frozenset({"text-delta", "reasoning-delta", "tool-input-delta"})
SETTLED_TOOL_CHUNKS = frozenset({"tool-output-available", "tool-output-error", "tool-output-denied"})
# Stored at once: a settled result must never run again, and a human may act on these right away.
IMMEDIATE_CHUNKS = SETTLED_TOOL_CHUNKS | {"tool-input-available", "tool-approval-request"}
CONTENT_CHUNKS = frozenset({"text-delta", "reasoning-delta", "tool-input-available"})
PROGRESS_DELTA_WINDOW_S = 5.0
MAX_CHUNK_BYTES = 1_800_000
MAX_SEGMENT_BYTES = 512_000

Publish = Callable[[list[tuple[int, str]]], Awaitable[None]]


@dataclass(frozen=True)
class SegmentWrite:
    cancel_requested: bool  # the turn was asked to stop: the segment was not written


# A requested cancel refuses the segment in the same statement: once the cancel has committed, no
# chunk of the turn is stored (and so none is sent), however late the worker hears of it.
_APPEND_SQL = """
WITH lease AS (
    UPDATE {fiber} SET lease_expires_at = now() + %(ttl)s, heartbeat_at = now(),
        snapshot = CASE WHEN %(reattach)s::jsonb IS NULL OR cancel_requested THEN snapshot
            ELSE jsonb_set(COALESCE(snapshot, '{{}}'::jsonb), '{{reattach}}', %(reattach)s::jsonb) END
    WHERE id = %(fiber_id)s AND fencing = %(fencing)s AND status = 'running'
    RETURNING conversation_id, cancel_requested
), progress AS (
    UPDATE {conversation} AS c SET progress = c.progress + %(credit)s
    FROM lease WHERE c.id = lease.conversation_id AND %(credit)s > 0 AND NOT lease.cancel_requested
    RETURNING c.id
), segment AS (
    INSERT INTO {segment} (stream_id, seq_start, seq_end, body, fencing, created_at)
    SELECT %(stream_id)s, %(seq_start)s, %(seq_end)s, %(body)s, %(fencing)s, now()
    FROM lease WHERE NOT lease.cancel_requested
    RETURNING 1
)
SELECT cancel_requested FROM lease
"""


def segment_append(
    *,
    fiber_id: Any,
    fencing: int,
    stream_id: Any,
    seq_start: int,
    seq_end: int,
    body: str,
    credit: int,
    reattach: str | None = None,
) -> SegmentWrite | None:
    """Write one segment if the fiber is still ours (None otherwise) and not asked to stop (then
    nothing is written), renewing its lease; `reattach` (a provider cursor, JSON) becomes the
    snapshot's "reattach" entry."""
    sql = _APPEND_SQL.format(
        fiber=Fiber._meta.db_table, conversation=Conversation._meta.db_table, segment=Segment._meta.db_table
    )
    params = {
        "ttl": lease_ttl(),
        "fiber_id": fiber_id,
        "fencing": fencing,
        "credit": credit,
        "stream_id": stream_id,
        "seq_start": seq_start,
        "seq_end": seq_end,
        "body": body,
        "reattach": reattach,
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return None if row is None else SegmentWrite(cancel_requested=bool(row[0]))


def stream_open(
    *, conversation_id: int, fiber_id: Any, fencing: int, request_id: str, message_id: str, continuation: bool
) -> Any:
    """Create the stream row of a turn, if the fiber is still ours."""
    with transaction.atomic():
        owned = Fiber.objects.select_for_update().filter(
            pk=fiber_id, fencing=fencing, status=Fiber.Status.RUNNING
        )
        if not owned.exists():
            raise LeaseLost(f"fiber {fiber_id} fencing {fencing}")
        stream = Stream.objects.create(
            conversation_id=conversation_id,
            fiber_id=fiber_id,
            request_id=request_id,
            message_id=message_id,
            is_continuation=continuation,
        )
    return stream.pk


def stream_chunks(stream_id: Any, *, after_seq: int = -1) -> list[tuple[int, str]]:
    """Stored chunks of a stream with seq > after_seq, in order, as (seq, body)."""
    chunks: list[tuple[int, str]] = []
    segments = Segment.objects.filter(stream_id=stream_id, seq_end__gt=after_seq).order_by("seq_start")
    for seq_start, body in segments.values_list("seq_start", "body"):
        for offset, chunk in enumerate(body.split("\n")):
            if seq_start + offset > after_seq:
                chunks.append((seq_start + offset, chunk))
    return chunks


def stream_last_seq(stream_id: Any) -> int:
    """The seq of a stream's last stored chunk (-1 when it has none)."""
    last = Segment.objects.filter(stream_id=stream_id).order_by("-seq_end").values_list("seq_end", flat=True)
    return next(iter(last[:1]), -1)


def stream_close(*, stream_id: Any, status: str) -> None:
    Stream.objects.filter(pk=stream_id, status=Stream.Status.STREAMING).update(
        status=status, completed_at=timezone.now()
    )


class StreamWriter:
    """Buffers the chunks of one stream and flushes them as segments, then publishes their frames."""

    def __init__(
        self,
        *,
        stream_id: Any,
        fiber_id: Any,
        fencing: int,
        request_id: str,
        continuation: bool,
        publish: Publish,
    ) -> None:
        self.stream_id = stream_id
        self.fiber_id = fiber_id
        self.fencing = fencing
        self.continuation = continuation
        self.publish = publish
        self.next_seq = 0
        self.stored_seq = -1  # the last chunk stored (and published)
        self.cancel_requested = False
        self.last_write = time.monotonic()
        self._request_id_json = dumps(request_id)
        self._buffer: list[tuple[int, str, str]] = []  # (seq, body, frame)
        self._buffer_bytes = 0
        self._buffered_since = 0.0
        self._credit = 0
        self._last_delta_credit = float("-inf")
        self._flushed_any = False
        self._cursor: dict[str, Any] | None = None  # the provider cursor of the buffered chunks
        self._lock = asyncio.Lock()
        self.buffered = asyncio.Event()
        self._flush_every = int(think_setting("FLUSH_EVERY_CHUNKS"))
        self._flush_interval = float(think_setting("FLUSH_INTERVAL_MS")) / 1000
        self._persist = bool(think_setting("STREAM_PERSIST"))

    def note_cursor(self, cursor: dict[str, Any]) -> None:
        """The provider cursor reached by the chunks added so far: stored with the next segment."""
        self._cursor = cursor

    def add(self, chunk: dict[str, Any], cursor: dict[str, Any] | None = None) -> bool:
        """Buffer one chunk; True when it must be flushed now (first content, tool milestone, full batch).

        `cursor`: where the provider's stored generation stands once this chunk is stored.
        """
        if cursor is not None:
            self._cursor = cursor
        chunk_type = chunk.get("type")
        body = encode_chunk(chunk)
        seq = self.next_seq
        self.next_seq += 1
        self._credit += self._progress_credit(chunk_type)
        frame = chunk_frame(self._request_id_json, body, seq, continuation=self.continuation)
        # Measuring bytes needs an encode: only do it for chunks that could be that large.
        if len(body) * 4 > MAX_CHUNK_BYTES and len(body.encode()) > MAX_CHUNK_BYTES:
            # Too big to store: it still goes out live, but a replay will not have it.
            logger.warning("chunk %s of stream %s is too large to store", seq, self.stream_id)
            body = encode_chunk({"type": "data-think-omitted", "data": {"seq": seq}, "transient": True})
        if not self._buffer:
            self._buffered_since = time.monotonic()
            self.buffered.set()  # wakes the turn's guard, which flushes this batch when it is due
        self._buffer.append((seq, body, frame))
        self._buffer_bytes += len(body)
        if chunk_type in IMMEDIATE_CHUNKS:
            return True
        if chunk_type in CONTENT_CHUNKS and not self._flushed_any:
            return True
        return len(self._buffer) >= self._flush_every or self._buffer_bytes >= MAX_SEGMENT_BYTES

    def _progress_credit(self, chunk_type: Any) -> int:
        if chunk_type in MILESTONE_CHUNKS:
            return 1
        if chunk_type in DELTA_CHUNKS:
            now = time.monotonic()
            if now - self._last_delta_credit >= PROGRESS_DELTA_WINDOW_S:
                self._last_delta_credit = now
                return 1
        return 0

    @property
    def flush_due(self) -> bool:
        return bool(self._buffer) and time.monotonic() - self._buffered_since >= self._flush_interval

    def seconds_until_due(self) -> float | None:
        """How long the oldest buffered chunk may still wait; None when nothing is buffered."""
        if not self._buffer:
            return None
        return max(0.0, self._buffered_since + self._flush_interval - time.monotonic())

    async def flush(self) -> None:
        """Write the buffer as one segment, then publish its frames. Raises LeaseLost when fenced out.

        Once the turn is asked to stop, the buffer is dropped instead: nothing more is stored or sent.
        """
        async with self._lock:
            if not self._buffer:
                return
            if self.cancel_requested:
                self.discard()
                return
            batch, credit, since, cursor = self._buffer, self._credit, self._buffered_since, self._cursor
            self._buffer, self._buffer_bytes, self._credit, self._cursor = [], 0, 0, None
            if self._persist and not await self._write(batch, credit, cursor):
                self.next_seq = self.stored_seq + 1  # refused: the cancel committed first
                return
            self._flushed_any = True
            self.stored_seq = batch[-1][0]
            await self.publish([(seq, frame) for seq, _, frame in batch])
            # Per batch, never per chunk: the oldest chunk's wait is the batch's worst latency.
            metrics.flush_observed(chunks=len(batch), oldest_age_s=time.monotonic() - since)

    async def stop(self) -> None:
        """The turn was asked to stop: wait for a flush in flight, then drop what is buffered."""
        async with self._lock:
            self.cancel_requested = True
            self.discard()

    def discard(self) -> None:
        """Drop what is buffered (a stopped turn): the stream ends after the last stored chunk."""
        self._buffer, self._buffer_bytes, self._credit, self._cursor = [], 0, 0, None
        self.next_seq = self.stored_seq + 1

    async def _write(
        self, batch: list[tuple[int, str, str]], credit: int, cursor: dict[str, Any] | None = None
    ) -> bool:
        """The segment write: one fenced statement that also renews the lease and credits progress.

        False when a cancel refused it (nothing was written)."""
        result = await db(
            segment_append,
            fiber_id=self.fiber_id,
            fencing=self.fencing,
            stream_id=self.stream_id,
            seq_start=batch[0][0],
            seq_end=batch[-1][0],
            body="\n".join(b for _, b, _ in batch),
            credit=credit,
            reattach=dumps(cursor) if cursor is not None else None,  # once per batch, never per chunk
        )
        if result is None:
            raise LeaseLost(f"fiber {self.fiber_id} fencing {self.fencing}")
        self.last_write = time.monotonic()
        if result.cancel_requested:
            self.cancel_requested = True
            return False
        return True
