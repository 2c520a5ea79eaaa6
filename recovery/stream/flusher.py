"""Group commit: one flusher per worker event loop stores every turn's chunks, a tick at a time.

Each tick takes the buffered chunks of the process's turns and writes them all (segments, fenced
lease renewals, progress credit) in one statement (`recovery.stream.buffer.segments_write`), then sends all
their frames to the web processes in one round trip (the fan-out chat registers, `register_fanout`).
What a tick costs is paid once per tick for the whole process, not once per turn per tick.

- Every `FLUSH_INTERVAL_MS` (100 ms) a tick takes every turn's pending chunks.
- A turn's first content, a settled tool result, a tool call a human must answer, and a full batch
  (`FLUSH_EVERY_CHUNKS`) are stored at once: they start a tick of their own right away, which takes
  the others that are due as well (first contents that arrive together share a write). The turn
  waits for the first three; after a full batch it reads on, and waits only once the database has
  fallen `BACKLOG_BATCHES` batches behind (recovery.stream.buffer).
- Turns with nothing to store get their lease renewed in the tick that comes after their
  `HEARTBEAT_INTERVAL_S`, in the same statement.
- A turn whose fencing number moved on is left out of the result, and told (LeaseLost); a turn asked
  to stop has its chunks refused by the statement, and is told; neither fails the others. A lost
  database stops every turn of the tick (their leases lapse into recovery).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from recovery.conf import setting
from recovery.exceptions import LeaseLost
from recovery.lease import liveness
from recovery.observe import metrics
from recovery.process.runtime import DATABASE_LOST, db
from recovery.stream.buffer import Batch, SegmentEntry, StreamWriter, segments_write

logger = logging.getLogger(__name__)

# (conversation id, request id) and the frames of one writer's batch, for every writer of a tick.
FanoutBatch = list[tuple[tuple[int, str], list[tuple[int, str]]]]
Fanout = Callable[[FanoutBatch], Awaitable[None]]

_fanout: Fanout | None = None
_flushers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Flusher] = weakref.WeakKeyDictionary()


def register_fanout(fanout: Fanout) -> None:
    """How the frames of a tick reach the web processes (chat registers it in its AppConfig.ready)."""
    global _fanout
    _fanout = fanout


def flusher() -> Flusher:
    """The flusher of the running event loop."""
    loop = asyncio.get_running_loop()
    found = _flushers.get(loop)
    if found is None:
        found = _flushers[loop] = Flusher()
    return found


class Flusher:
    def __init__(self) -> None:
        self.writers: set[StreamWriter] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._waiting: dict[StreamWriter, list[asyncio.Future[None]]] = {}
        self._inflight: dict[StreamWriter, asyncio.Future[None]] = {}
        self.ticks = 0  # statements written (benchmarks read it)

    # -- the turns' side ------------------------------------------------------------------------------
    def register(self, writer: StreamWriter) -> None:
        """A writer whose chunks and lease this flusher keeps (until `unregister`)."""
        self.writers.add(writer)
        self._start()

    def unregister(self, writer: StreamWriter) -> None:
        self.writers.discard(writer)

    def poke(self) -> None:
        """Something urgent was buffered: tick now (after the write in flight, if any)."""
        self._wake.set()
        self._start()

    async def flush(self, writer: StreamWriter) -> None:
        """Store and publish what `writer` has buffered; raises LeaseLost once it is fenced out."""
        await self.settle(writer)
        if writer.stopped is not None:
            raise writer.stopped
        if writer.cancel_requested:
            writer.discard()
            return
        if not writer.pending:
            return
        done = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(writer, []).append(done)
        self.poke()
        await done

    async def settle(self, writer: StreamWriter) -> None:
        """Wait until no write of `writer`'s chunks is in flight (its outcome is the writer's to report).

        Again after each: the tick that follows a write may take the writer's next batch before this
        resumes, and a turn that went on to finish would then close its fiber under that batch.
        """
        while (inflight := self._inflight.get(writer)) is not None:
            await asyncio.wait([inflight])

    # -- the ticks ---------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="think-flusher")

    async def _run(self) -> None:
        heartbeat_s = float(setting("HEARTBEAT_INTERVAL_S"))
        interval = float(setting("FLUSH_INTERVAL_MS")) / 1000
        next_tick = time.monotonic() + interval
        while self.writers or self._waiting:
            # A steady cadence while any turn is registered: no chunk waits longer than the interval,
            # and no writer has to wake the flusher for its batch (only for what is stored at once).
            if not self._wake.is_set():
                try:  # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel
                    async with asyncio.timeout(max(0.0, next_tick - time.monotonic())):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            self._wake.clear()
            now = time.monotonic()
            regular = now >= next_tick
            if regular:
                next_tick = max(next_tick + interval, now + interval / 2)
            await self._tick(now, heartbeat_s, regular=regular)

    @staticmethod
    def _renew_after(*, heartbeat_s: float) -> float:
        """How long a quiet turn's lease goes unrenewed. While this process has lost its liveness
        session, not at all: every tick renews, so its fibers never look abandoned to the session
        detector (recovery.lease.liveness), which confirms a suspicion a few ticks later."""
        return 0.0 if liveness.degraded() else heartbeat_s

    async def _tick(self, now: float, heartbeat_s: float, *, regular: bool) -> None:
        # A writer nobody registered (a test's) is flushed when asked, and its lease is not kept.
        live = [w for w in {*self.writers, *self._waiting} if w.stopped is None]
        # A regular tick takes everyone's chunks; one started at once, the urgent and the due ones.
        batches: list[Batch] = []
        for writer in live:
            if writer.pending and not writer.cancel_requested:
                if regular or writer.due(now) or writer in self._waiting:
                    batch = writer.take()
                    if batch is not None:
                        batches.append(batch)
            elif writer.cancel_requested:
                writer.discard()
        taken = {b.writer for b in batches}
        renew_after = self._renew_after(heartbeat_s=heartbeat_s)
        renewals = [
            w
            for w in self.writers
            if w.stopped is None and w not in taken and now - w.last_write >= renew_after
        ]
        if batches or renewals:
            await self._write(batches, renewals)
        for writer in [w for w in self._waiting if not w.pending or w.stopped is not None]:
            for waiter in self._waiting.pop(writer):
                if not waiter.done():
                    waiter.set_result(None)

    async def _write(self, batches: list[Batch], renewals: list[StreamWriter]) -> None:
        inflight = asyncio.get_running_loop().create_future()
        for batch in batches:
            self._inflight[batch.writer] = inflight
        try:
            entries = [b.entry for b in batches if b.writer.persist]
            entries += [SegmentEntry(w.fiber_id, w.fencing) for w in renewals if w.persist]
            try:
                results = await _write_entries(entries) if entries else {}
            except DATABASE_LOST as exc:
                logger.warning("database lost while flushing %s turns: %s", len(batches) + len(renewals), exc)
                for writer in [*(b.writer for b in batches), *renewals]:
                    self._fail(writer, "database", exc)
                return
            self.ticks += 1
            stored: list[Batch] = []
            for batch in batches:
                if self._settle(batch.writer, results):
                    batch.writer.stored(batch)
                    stored.append(batch)
            for writer in renewals:
                if self._settle(writer, results):
                    writer.last_write = time.monotonic()
            await _publish(stored)
            now = time.monotonic()
            for batch in stored:  # per batch, never per chunk: the oldest chunk's wait is the batch's worst
                metrics.flush_observed(chunks=batch.chunks, oldest_age_s=now - batch.since)
        finally:
            for batch in batches:
                if self._inflight.get(batch.writer) is inflight:
                    del self._inflight[batch.writer]
            inflight.set_result(None)

    def _settle(self, writer: StreamWriter, results: dict[str, Any]) -> bool:
        """True when the writer's part was written; otherwise it is told why not."""
        if not writer.persist:
            return True
        result = results.get(str(writer.fiber_id))
        if result is None:
            self._fail(writer, "lease", LeaseLost(f"fiber {writer.fiber_id} fencing {writer.fencing}"))
            return False
        if result.cancel_requested:
            writer.stop_with("cancel")
            return False
        return True

    def _fail(self, writer: StreamWriter, reason: str, error: BaseException) -> None:
        writer.stop_with(reason, error)
        for waiter in self._waiting.pop(writer, []):
            if not waiter.done():
                waiter.set_exception(error)


async def _write_entries(entries: list[SegmentEntry]) -> dict[str, Any]:
    """The group statement; a deadlock (a clear or an answer locking the same rows the other way
    round) is tried once more, since Postgres rolled this statement back."""
    try:
        return await db(segments_write, entries)
    except DATABASE_LOST as exc:
        if not _is_deadlock(exc):
            raise
        logger.info("group write deadlocked; trying once more")
        return await db(segments_write, entries)


def _is_deadlock(exc: BaseException) -> bool:
    import psycopg.errors

    return isinstance(exc.__cause__, psycopg.errors.DeadlockDetected | psycopg.errors.SerializationFailure)


async def _publish(batches: list[Batch]) -> None:
    """Every stored batch's frames: the registered fan-out sends those that name their conversation
    in one go; a writer with its own `publish` (tests, tools) sends its own."""
    together = [(b.writer.fanout, b.frames) for b in batches if b.writer.fanout is not None and _fanout]
    if together:
        assert _fanout is not None
        await _fanout(together)
    for batch in batches:
        if (batch.writer.fanout is None or _fanout is None) and batch.writer.publish is not None:
            await batch.writer.publish(batch.frames)
