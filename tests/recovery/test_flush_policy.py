"""When a turn's chunks are stored, and when the turn waits for it (recovery.stream.buffer.StreamWriter.add
with the process's flusher): a full batch starts a write and the turn reads on; only a backlog of
full batches, or what must be stored before anything else happens, holds the turn."""

from __future__ import annotations

import asyncio
import json

from django.conf import settings
from django.test import override_settings

from recovery.stream.buffer import BACKLOG_BATCHES, ChunkPolicy, StreamWriter
from recovery.stream.flusher import flusher
from tests.recovery.test_metrics import HeldPublish, Published, writer

# A regular tick every 10 s: within a test, only a poke can start one.
POLICY = {**settings.THINK, "STREAM_PERSIST": False, "FLUSH_EVERY_CHUNKS": 10, "FLUSH_INTERVAL_MS": 10_000}


def delta(n: int) -> dict[str, str]:
    return {"type": "text-delta", "id": "t1", "delta": f" {n}"}


async def wait_for_batches(published: Published, count: int) -> None:
    async with asyncio.timeout(5):
        while len(published.batches) < count:
            await asyncio.sleep(0.005)


@override_settings(THINK=POLICY)
async def test_first_content_holds_the_turn_and_a_full_batch_does_not() -> None:
    published = Published()
    stream = writer(published)
    flusher().register(stream)
    try:
        assert stream.add({"type": "start"}) is False
        assert stream.add(delta(0)) is True  # the first content: the turn waits until it is stored
        await stream.flush()
        assert len(published.batches) == 1

        # Ten more deltas fill a batch: none holds the turn, and the flusher stores them on its own,
        # long before its next regular tick.
        assert [stream.add(delta(n)) for n in range(1, 11)] == [False] * 10
        await wait_for_batches(published, 2)
        assert not stream.pending
        sent = [seq for batch in published.batches for seq, _ in batch]
        assert sent == list(range(stream.next_seq))  # gap-free, in order
    finally:
        flusher().unregister(stream)


@override_settings(THINK=POLICY)
async def test_a_backlog_of_full_batches_holds_the_turn_until_it_is_stored() -> None:
    published = HeldPublish()  # the first write stays in flight until released
    stream = writer(published)
    flusher().register(stream)
    try:
        stream.add({"type": "start"})
        stream.add(delta(0))
        first = asyncio.create_task(stream.flush())
        await asyncio.sleep(0.02)
        assert not first.done()  # its write is held

        limit = 10 * BACKLOG_BATCHES
        held = [stream.add(delta(n)) for n in range(1, limit + 1)]
        assert held[: limit - 1] == [False] * (limit - 1)
        assert held[-1] is True  # the database fell behind by BACKLOG_BATCHES batches: wait now
        backlog = asyncio.create_task(stream.flush())
        await asyncio.sleep(0.02)
        assert not backlog.done()

        published.release.set()
        await asyncio.wait_for(backlog, 5)
        await first
        assert not stream.pending
        sent = [seq for batch in published.batches for seq, _ in batch]
        assert sent == list(range(stream.next_seq))
    finally:
        flusher().unregister(stream)


@override_settings(THINK=POLICY)
async def test_a_tool_milestone_holds_the_turn() -> None:
    stream = writer(Published())
    stream.add({"type": "start"})
    stream.add(delta(0))
    await stream.flush()
    assert stream.add({"type": "tool-input-available", "toolCallId": "c", "toolName": "x", "input": {}})


@override_settings(THINK=POLICY)
async def test_a_batch_short_of_full_waits_for_the_tick() -> None:
    published = Published()
    stream = writer(published)
    flusher().register(stream)
    try:
        stream.add(delta(0))
        await stream.flush()
        for n in range(1, 10):
            stream.add(delta(n))
        await asyncio.sleep(0.1)
        assert len(published.batches) == 1 and stream.pending  # nothing poked the flusher
    finally:
        flusher().unregister(stream)


# What the chunks mean comes from the owner's policy: the buffer knows no chunk type of its own.
JOBS = ChunkPolicy(
    immediate=frozenset({"job-done"}),
    content=frozenset({"log"}),
    milestones=frozenset({"job-done"}),
    deltas=frozenset({"log"}),
    merge=lambda chunks: [c for c in chunks if c["type"] != "noise"],
    omitted=lambda seq: {"type": "job-omitted", "seq": seq},
)


@override_settings(THINK=POLICY)
async def test_the_buffer_follows_the_policy_it_is_given() -> None:
    published = Published()
    stream = StreamWriter(
        stream_id=None, fiber_id=None, fencing=1, frame=lambda body, seq: body, policy=JOBS, publish=published
    )
    assert stream.add({"type": "text-delta", "id": "t", "delta": "x"}) is False, (
        "chat's content means nothing"
    )
    assert stream.add({"type": "log", "line": "a"}) is True, "its first content is stored before going on"
    await stream.flush()
    assert stream.add({"type": "noise"}) is False
    assert stream.add({"type": "job-done"}) is True, "an immediate chunk holds the work"
    batch = stream.take()
    assert batch is not None
    assert [json.loads(body)["type"] for _, body in batch.frames] == ["job-done"], "merged by its rule"
    assert batch.entry.credit == 1, "a milestone credits progress"
    assert [json.loads(body)["type"] for _, body in published.batches[0]] == ["text-delta", "log"]


def test_without_a_policy_no_chunk_holds_the_work_or_is_merged() -> None:
    stream = StreamWriter(stream_id=None, fiber_id=None, fencing=1, frame=lambda body, seq: body)
    chunks = [{"type": "tool-input-available"}, {"type": "text-delta", "id": "t", "delta": "a"}] * 2
    assert [stream.add(dict(chunk)) for chunk in chunks] == [False] * 4
    batch = stream.take()
    assert batch is not None and len(batch.frames) == 4 and batch.entry.credit == 0
