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

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from django.db import connection
from django.utils import timezone

from recovery.conf import setting
from recovery.exceptions import LeaseLost
from recovery.lease.fibers import CURSOR_SLOT, FiberId, lease_ttl
from recovery.models import Fiber, Segment, Stream, owner_model
from recovery.stream.encoding import dumps

logger = logging.getLogger(__name__)

PROGRESS_DELTA_WINDOW_S = 5.0
MAX_CHUNK_BYTES = 1_800_000
MAX_SEGMENT_BYTES = 512_000
# A full batch starts a write and the turn reads on; it waits only once this many batches (or bytes)
# are buffered, the database being slower than the model: memory stays bounded, and so does what a
# kill of the worker leaves for recovery to generate again. bench/throughput.py, one unpaced turn:
# 8 batches 0.43x persistence-off, 50 batches 0.75x, unbounded 0.69x (noise; the rest is per turn).
BACKLOG_BATCHES = 50
BACKLOG_BYTES = 4 * MAX_SEGMENT_BYTES

Publish = Callable[[list[tuple[int, str]]], Awaitable[None]]
# A chunk of the owning app (chat's: chat.types.Chunk) as the buffer sees it: a JSON object with a "type".
Chunk = Mapping[str, Any]


def _unmerged(chunks: list[Chunk]) -> list[Chunk]:
    return chunks


def _rough_size(chunk: Chunk) -> int:
    return 64


def _omitted(seq: int) -> Chunk:
    return {"type": "omitted", "seq": seq}


@dataclass(frozen=True)
class ChunkPolicy:
    """What the owning app's chunks (dicts with a "type") mean to the buffer, which knows no chunk type
    of its own; the owner gives one to each StreamWriter.

    `immediate` chunks are stored before the work goes on (a settled tool result must never run twice,
    a human may act on an approval request at once); so is the first `content` chunk, so that recovery
    finds content; each of the `milestones` credits progress, `deltas` credit it at most once per
    PROGRESS_DELTA_WINDOW_S. When a batch is taken its chunks pass through `merge` (consecutive deltas
    of one part into one chunk, say). `size` estimates a chunk's bytes cheaply, for the segment and
    backlog bounds; `omitted` is what is stored, by seq, in place of a chunk too large to store.
    """

    immediate: frozenset[str] = frozenset()
    content: frozenset[str] = frozenset()
    milestones: frozenset[str] = frozenset()
    deltas: frozenset[str] = frozenset()
    merge: Callable[[list[Chunk]], list[Chunk]] = _unmerged
    size: Callable[[Chunk], int] = _rough_size
    omitted: Callable[[int], Chunk] = _omitted


class GroupCommit(Protocol):
    """What a writer asks of its process's group commit (recovery.stream.flusher's Flusher)."""

    def poke(self) -> None: ...
    async def flush(self, writer: StreamWriter) -> None: ...
    async def settle(self, writer: StreamWriter) -> None: ...


_group_commit: Callable[[], GroupCommit] | None = None


def register_group_commit(get: Callable[[], GroupCommit]) -> None:
    """How writers reach the group commit of the loop they run on: RecoveryConfig.ready() registers
    recovery.stream.flusher.flusher (the flusher imports this module, not the other way round)."""
    global _group_commit
    _group_commit = get


def group_commit() -> GroupCommit:
    if _group_commit is None:
        raise RuntimeError("no group commit registered (RecoveryConfig.ready() registers the flusher)")
    return _group_commit()


# The live frame of one stored chunk: (its body, its seq) -> the text a client is sent (the owner's
# wire format; the chat app's is chat.protocol.chunk_framer).
Frame = Callable[[str, int], str]


@dataclass(frozen=True)
class SegmentWrite:
    cancel_requested: bool  # the turn was asked to stop: the segment was not written


@dataclass(frozen=True)
class SegmentEntry:
    """One fiber's part of a group write: its segments (none for a lease renewal alone) and credit."""

    fiber_id: FiberId
    fencing: int
    stream_id: Any = None
    segments: tuple[tuple[int, int, str], ...] = ()  # (seq_start, seq_end, body)
    credit: int = 0
    reattach: str | None = None  # a provider cursor (JSON): the snapshot's CURSOR_SLOT


# One statement for every turn a worker process flushes in a tick: their segments, their fenced lease
# renewals and their progress credit. A fiber whose fencing number moved on (or that is no longer
# running) is simply not in the result, and nothing of it is written; the others are. A requested
# cancel refuses the fiber's segments in the same statement: once the cancel has committed, no chunk
# of the turn is stored (and so none is sent), however late its worker hears of it.
# Locks go conversation first, then fiber, as everywhere else (a clear, a turn's finish): `owners` locks
# the conversations that get credit, in id order, and the lease update waits for all of them (the
# uncorrelated count is a one-time filter, evaluated before the update locks any fiber row). Locking
# the fiber first deadlocked with a clear of its conversation (tests/recovery/test_lock_order.py).
_GROUP_SQL = """
WITH input AS (
    SELECT * FROM unnest(
        %(fiber)s::uuid[], %(fencing)s::bigint[], %(stream)s::uuid[], %(seq_start)s::int[],
        %(seq_end)s::int[], %(body)s::text[], %(credit)s::int[], %(reattach)s::jsonb[]
    ) AS i(fiber_id, fencing, stream_id, seq_start, seq_end, body, credit, reattach)
), per_fiber AS (
    SELECT DISTINCT ON (fiber_id) fiber_id, fencing, reattach
    FROM input ORDER BY fiber_id, seq_end DESC NULLS LAST
), owners AS (
    SELECT c.id FROM {conversation} AS c
    WHERE c.id IN (
        SELECT f.conversation_id FROM {fiber} AS f JOIN input AS i ON i.fiber_id = f.id WHERE i.credit > 0
    )
    ORDER BY c.id
    FOR UPDATE OF c
), lease AS (
    UPDATE {fiber} AS f SET lease_expires_at = now() + %(ttl)s, heartbeat_at = now(),
        snapshot = CASE WHEN p.reattach IS NULL OR f.cancel_requested THEN f.snapshot
            ELSE jsonb_set(COALESCE(f.snapshot, '{{}}'::jsonb), %(cursor_path)s::text[], p.reattach) END
    FROM per_fiber AS p
    WHERE f.id = p.fiber_id AND f.fencing = p.fencing AND f.status = 'running'
        AND (SELECT count(*) FROM owners) >= 0
    RETURNING f.id, f.conversation_id, f.cancel_requested
), credit AS (
    SELECT l.conversation_id, sum(i.credit) AS credit
    FROM input AS i JOIN lease AS l ON l.id = i.fiber_id
    WHERE NOT l.cancel_requested AND i.credit > 0
    GROUP BY l.conversation_id
), progress AS (
    UPDATE {conversation} AS c SET progress = c.progress + credit.credit
    FROM credit WHERE c.id = credit.conversation_id
    RETURNING c.id
), segments AS (
    INSERT INTO {segment} (stream_id, seq_start, seq_end, body, fencing, created_at)
    SELECT i.stream_id, i.seq_start, i.seq_end, i.body, i.fencing, now()
    FROM input AS i JOIN lease AS l ON l.id = i.fiber_id
    WHERE NOT l.cancel_requested AND i.body IS NOT NULL
    RETURNING 1
)
SELECT id, cancel_requested FROM lease
"""


def segments_write(entries: list[SegmentEntry]) -> dict[Any, SegmentWrite]:
    """Write a group of fibers' segments and renew their leases in one statement; the result has an
    entry, by fiber id as text, for each fiber that is still ours (a missing one was fenced out: nothing
    of it was written)."""
    rows: dict[str, list[Any]] = {k: [] for k in ("fiber", "fencing", "stream", "seq_start", "seq_end")}
    rows.update(body=[], credit=[], reattach=[])
    for entry in entries:
        segments = entry.segments or ((None, None, None),)
        for index, (seq_start, seq_end, body) in enumerate(segments):
            last = index == len(segments) - 1
            rows["fiber"].append(entry.fiber_id)
            rows["fencing"].append(entry.fencing)
            rows["stream"].append(entry.stream_id if body is not None else None)
            rows["seq_start"].append(seq_start)
            rows["seq_end"].append(seq_end)
            rows["body"].append(body)
            rows["credit"].append(entry.credit if last else 0)
            rows["reattach"].append(entry.reattach if last else None)
    sql = _GROUP_SQL.format(
        fiber=Fiber._meta.db_table, conversation=owner_model()._meta.db_table, segment=Segment._meta.db_table
    )
    with connection.cursor() as cursor:
        params: dict[str, Any] = {**rows, "ttl": lease_ttl(), "cursor_path": [CURSOR_SLOT]}
        cursor.execute(sql, params)
        return {
            str(fiber): SegmentWrite(cancel_requested=bool(cancel)) for fiber, cancel in cursor.fetchall()
        }


def segment_append(
    *,
    fiber_id: FiberId,
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
    snapshot's CURSOR_SLOT. The group write of one fiber."""
    entry = SegmentEntry(fiber_id, fencing, stream_id, ((seq_start, seq_end, body),), credit, reattach)
    return segments_write([entry]).get(str(fiber_id))


_STREAM_OPEN = """
INSERT INTO {stream}
    (id, conversation_id, fiber_id, request_id, message_id, status, is_continuation, created_at)
SELECT %(id)s, %(conversation)s, f.id, %(request)s, %(message)s, 'streaming', %(continuation)s, now()
FROM {fiber} AS f WHERE f.id = %(fiber)s AND f.fencing = %(fencing)s AND f.status = 'running'
RETURNING id
"""


def stream_open(
    *,
    conversation_id: int,
    fiber_id: FiberId,
    fencing: int,
    request_id: str,
    message_id: str,
    continuation: bool,
) -> Any:
    """Create the stream row of a turn, if the fiber is still ours (one fenced statement)."""
    sql = _STREAM_OPEN.format(stream=Stream._meta.db_table, fiber=Fiber._meta.db_table)
    params: dict[str, Any] = {
        "id": uuid.uuid4(),
        "conversation": conversation_id,
        "request": request_id,
        "message": message_id,
        "continuation": continuation,
        "fiber": fiber_id,
        "fencing": fencing,
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        raise LeaseLost(f"fiber {fiber_id} fencing {fencing}")
    return row[0]


def stream_chunks(
    stream_id: Any, *, after_seq: int = -1, through_seq: int | None = None, limit: int | None = None
) -> list[tuple[int, str]]:
    """Stored chunks of a stream with after_seq < seq (<= through_seq), in order, as (seq, body).

    `limit`: at most that many (a page; the next one starts after the last seq returned).
    """
    chunks: list[tuple[int, str]] = []
    segments = Segment.objects.filter(stream_id=stream_id, seq_end__gt=after_seq)
    if through_seq is not None:
        segments = segments.filter(seq_start__lte=through_seq)
    rows = segments.order_by("seq_start").values_list("seq_start", "body")
    for seq_start, body in rows[:limit] if limit is not None else rows:  # every segment has a chunk
        for offset, chunk in enumerate(body.split("\n")):
            seq = seq_start + offset
            if seq > after_seq and (through_seq is None or seq <= through_seq):
                chunks.append((seq, chunk))
    return chunks[:limit] if limit is not None else chunks


def stream_last_seq(stream_id: Any) -> int:
    """The seq of a stream's last stored chunk (-1 when it has none)."""
    last = Segment.objects.filter(stream_id=stream_id).order_by("-seq_end").values_list("seq_end", flat=True)
    return next(iter(last[:1]), -1)


def stream_close(*, stream_id: Any, status: str) -> None:
    Stream.objects.filter(pk=stream_id, status=Stream.Status.STREAMING).update(
        status=status, completed_at=timezone.now()
    )


class StreamWriter:
    """Buffers the chunks of one stream; the process's flusher (`recovery.stream.flusher`) stores them as
    segments, in one statement with every other turn's, then publishes their frames.

    Chunks are kept as they come and encoded when they are taken: consecutive deltas of one text,
    reasoning or tool-input part are coalesced into one chunk then, and sequence numbers are given to
    what is stored, so `seq` stays gap-free and a client renders the same message.
    """

    def __init__(
        self,
        *,
        stream_id: Any,
        fiber_id: FiberId,
        fencing: int,
        frame: Frame,
        policy: ChunkPolicy = ChunkPolicy(),  # noqa: B008 (frozen: one shared default is fine)
        publish: Publish | None = None,
        fanout: tuple[int, str] | None = None,
    ) -> None:
        """`frame` makes each stored chunk's live frame; `policy` says what the chunks mean to the
        buffer; `publish` sends a batch of frames; `fanout` (conversation id, request id) lets the flusher
        send every writer's frames of a tick together instead (chat.broadcast)."""
        self.stream_id = stream_id
        self.fiber_id = fiber_id
        self.fencing = fencing
        self.frame = frame
        self.policy = policy
        self.publish = publish
        self.fanout = fanout
        self.next_seq = 0
        self.stored_seq = -1  # the last chunk stored (and published)
        self.cancel_requested = False
        self.stopped: BaseException | None = None  # LeaseLost or a database error: it writes no more
        self.on_stop: Callable[[str, BaseException | None], None] | None = (
            None  # ("cancel"|"lease"|"database")
        )
        self.last_write = time.monotonic()
        self._buffer: list[Chunk] = []
        self._buffer_bytes = 0  # a rough size, from the deltas' lengths
        self._buffered_since = 0.0
        self._credit = 0
        self._last_delta_credit = float("-inf")
        self._flushed_any = False
        self._urgent = False
        self._cursor: dict[str, Any] | None = None  # the provider cursor of the buffered chunks
        self._flush_every = int(setting("FLUSH_EVERY_CHUNKS"))
        self.flush_interval = float(setting("FLUSH_INTERVAL_MS")) / 1000
        self.persist = bool(setting("STREAM_PERSIST"))

    @property
    def pending(self) -> bool:
        return bool(self._buffer)

    @property
    def urgent(self) -> bool:
        return self._urgent

    @property
    def buffered_since(self) -> float:
        return self._buffered_since

    def note_cursor(self, cursor: dict[str, Any]) -> None:
        """The provider cursor reached by the chunks added so far: stored with the next segment."""
        self._cursor = cursor

    def add(self, chunk: Chunk, cursor: dict[str, Any] | None = None) -> bool:
        """Buffer one chunk; True when the turn must wait until it is stored (first content, a tool
        milestone, or a backlog of `BACKLOG_BATCHES` full batches).

        A full batch is urgent without holding the turn: it starts a tick (`poke`) and the turn reads on.
        `cursor`: where the provider's stored generation stands once this chunk is stored.
        """
        if cursor is not None:
            self._cursor = cursor
        policy = self.policy
        chunk_type = chunk.get("type")
        self._credit += self._progress_credit(chunk_type)
        if not self._buffer:
            self._buffered_since = time.monotonic()
        self._buffer.append(chunk)
        self._buffer_bytes += policy.size(chunk)
        if chunk_type in policy.immediate or (chunk_type in policy.content and not self._flushed_any):
            self._urgent = True
            return True
        if len(self._buffer) >= self._flush_every or self._buffer_bytes >= MAX_SEGMENT_BYTES:
            if (
                len(self._buffer) >= self._flush_every * BACKLOG_BATCHES
                or self._buffer_bytes >= BACKLOG_BYTES
            ):
                return True
            if not self._urgent:
                self._urgent = True
                self._poke()
        return False

    def _poke(self) -> None:
        group_commit().poke()

    def _progress_credit(self, chunk_type: Any) -> int:
        if chunk_type in self.policy.milestones:
            return 1
        if chunk_type in self.policy.deltas:
            now = time.monotonic()
            if now - self._last_delta_credit >= PROGRESS_DELTA_WINDOW_S:
                self._last_delta_credit = now
                return 1
        return 0

    def due(self, now: float) -> bool:
        return bool(self._buffer) and (self._urgent or now - self._buffered_since >= self.flush_interval)

    def take(self) -> Batch | None:
        """The buffered chunks as a batch to store (coalesced, encoded, numbered); None when empty."""
        if not self._buffer:
            return None
        chunks, credit, cursor, since = self._buffer, self._credit, self._cursor, self._buffered_since
        self._buffer, self._buffer_bytes, self._credit, self._cursor, self._urgent = [], 0, 0, None, False
        bodies: list[str] = []
        frames: list[tuple[int, str]] = []
        for chunk in self.policy.merge(chunks):
            seq = self.next_seq
            self.next_seq += 1
            body = dumps(chunk)
            frames.append((seq, self.frame(body, seq)))
            # Measuring bytes needs an encode: only do it for chunks that could be that large.
            if len(body) * 4 > MAX_CHUNK_BYTES and len(body.encode()) > MAX_CHUNK_BYTES:
                # Too big to store: it still goes out live, but a replay will not have it.
                logger.warning("chunk %s of stream %s is too large to store", seq, self.stream_id)
                body = dumps(self.policy.omitted(seq))
            bodies.append(body)
        first = frames[0][0]
        segments = _segments(first, bodies)
        reattach = dumps(cursor) if cursor is not None else None  # once per batch, never per chunk
        entry = SegmentEntry(self.fiber_id, self.fencing, self.stream_id, segments, credit, reattach)
        return Batch(self, entry, frames, len(chunks), since)

    def stored(self, batch: Batch) -> None:
        """The flusher stored `batch` (it publishes its frames next)."""
        self._flushed_any = True
        self.stored_seq = batch.frames[-1][0]
        self.last_write = time.monotonic()

    def refused(self) -> None:
        """A cancel refused the batch: it is dropped, and so is everything the turn adds from now on."""
        self.cancel_requested = True
        self.discard()
        self.last_write = time.monotonic()

    def discard(self) -> None:
        """Drop what is buffered (a stopped turn): the stream ends after the last stored chunk."""
        self._buffer, self._buffer_bytes, self._credit, self._cursor, self._urgent = [], 0, 0, None, False
        self.next_seq = self.stored_seq + 1

    def stop_with(self, reason: str, error: BaseException | None = None) -> None:
        """The flusher learnt the turn must stop: asked to ("cancel"), fenced out ("lease"), or the
        database is gone ("database"); the turn runner is told through `on_stop`."""
        if reason == "cancel":
            self.refused()
        else:
            self.stopped = error
        if self.on_stop is not None:
            self.on_stop(reason, error)

    async def flush(self) -> None:
        """Store what is buffered now (with whatever else the process flushes), then publish it.

        Raises LeaseLost when fenced out; once the turn was asked to stop it stores nothing more.
        """
        await group_commit().flush(self)

    async def stop(self) -> None:
        """The turn was asked to stop: wait for a write in flight, then drop what is buffered."""
        await group_commit().settle(self)
        self.cancel_requested = True
        self.discard()


@dataclass
class Batch:
    """What one writer hands to a tick of the flusher."""

    writer: StreamWriter
    entry: SegmentEntry
    frames: list[tuple[int, str]]
    chunks: int  # as the turn added them (before coalescing)
    since: float  # when the oldest of them was added


def _segments(first: int, bodies: list[str]) -> tuple[tuple[int, int, str], ...]:
    """Bodies as segment rows (seq_start, seq_end, newline-joined bodies), none over MAX_SEGMENT_BYTES."""
    segments: list[tuple[int, int, str]] = []
    start, size, group = first, 0, []  # type: ignore[var-annotated]
    for offset, body in enumerate(bodies):
        if group and size + len(body) > MAX_SEGMENT_BYTES:
            segments.append((start, start + len(group) - 1, "\n".join(group)))
            start, size, group = first + offset, 0, []
        group.append(body)
        size += len(body) + 1
    segments.append((start, start + len(group) - 1, "\n".join(group)))
    return tuple(segments)
