"""Where a reattach cursor is stored: in the fiber snapshot, by the same statement as the segment it
belongs to, beside whatever else the snapshot holds (the chat snapshot, stash() data)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from chat.protocol import chunk_framer
from chat.turn.chunking import UI_CHUNK_POLICY
from recovery.lease.fibers import fiber_stash
from recovery.process.runtime import db
from recovery.stream.buffer import StreamWriter
from tests.operator_support import terminate_new_backends
from tests.recovery.test_engine_store import (
    START,
    append,
    chunk_bodies,
    claim,
    fiber_row,
    make_conversation,
    make_fiber,
    open_stream,
)

CURSOR = {"responseId": "resp_1", "sequenceNumber": 12, "done": False}


@pytest.fixture(scope="module", autouse=True)
def close_db_thread_connections(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    yield from terminate_new_backends(django_db_blocker)


@pytest.mark.django_db
def test_the_segment_write_records_the_cursor_in_the_same_statement() -> None:
    claimed = claim(make_fiber(make_conversation(), stash={"mine": 1}))
    stream_id = open_stream(claimed)
    with CaptureQueriesContext(connection) as queries:
        assert append(claimed, stream_id, chunk_bodies(START), reattach=json.dumps(CURSOR)) is not None
    assert len(queries.captured_queries) == 1
    snapshot = fiber_row(claimed.fiber_id).snapshot
    assert snapshot["reattach"] == CURSOR
    assert snapshot["user"] == {"mine": 1} and snapshot["chat"]["requestId"] == claimed.request_id

    append(claimed, stream_id, chunk_bodies(START), seq_start=1)  # a batch without a cursor
    assert fiber_row(claimed.fiber_id).snapshot["reattach"] == CURSOR, "kept, not cleared"


@pytest.mark.django_db
def test_a_fenced_out_writer_records_no_cursor() -> None:
    claimed = claim(make_fiber(make_conversation()))
    stream_id = open_stream(claimed)
    stale = claimed.__class__(**{**claimed.__dict__, "fencing": claimed.fencing - 1})
    assert append(stale, stream_id, chunk_bodies(START), reattach=json.dumps(CURSOR)) is None
    assert "reattach" not in (fiber_row(claimed.fiber_id).snapshot or {})


@pytest.mark.django_db
def test_stash_keeps_the_cursor_and_the_cursor_keeps_the_stash() -> None:
    claimed = claim(make_fiber(make_conversation()))
    stream_id = open_stream(claimed)
    append(claimed, stream_id, chunk_bodies(START), reattach=json.dumps(CURSOR))
    fiber_stash(fiber_id=claimed.fiber_id, fencing=claimed.fencing, data=[1, "two"])
    snapshot = fiber_row(claimed.fiber_id).snapshot
    assert snapshot["user"] == [1, "two"] and snapshot["reattach"] == CURSOR


@pytest.mark.django_db(transaction=True)
async def test_the_writer_stores_the_cursor_of_the_chunks_it_flushes() -> None:
    conversation = await db(make_conversation)
    claimed = await db(lambda: claim(make_fiber(conversation)))
    stream_id = await db(open_stream, claimed)
    published: list[Any] = []

    async def publish(frames: list[tuple[int, str]]) -> None:
        published.append(frames)

    writer = StreamWriter(
        stream_id=stream_id,
        fiber_id=claimed.fiber_id,
        fencing=claimed.fencing,
        frame=chunk_framer(claimed.request_id),
        policy=UI_CHUNK_POLICY,
        publish=publish,
    )

    async def stored() -> Any:
        return (await db(fiber_row, claimed.fiber_id)).snapshot.get("reattach")

    writer.add({"type": "start"})
    writer.note_cursor({"responseId": "r", "sequenceNumber": 0})  # after the chunks added so far
    await writer.flush()
    assert await stored() == {"responseId": "r", "sequenceNumber": 0}

    writer.add({"type": "text-start", "id": "t"})
    writer.add({"type": "text-delta", "id": "t", "delta": "1"}, {"responseId": "r", "sequenceNumber": 3})
    await writer.flush()
    assert await stored() == {"responseId": "r", "sequenceNumber": 3}

    writer.add({"type": "text-delta", "id": "t", "delta": " 2"})  # no cursor: the stored one stays
    await writer.flush()
    assert await stored() == {"responseId": "r", "sequenceNumber": 3}
    assert len(published) == 3
