"""A long stream is replayed a page of stored chunks at a time (chat.wire.resume.REPLAY_PAGE_CHUNKS): every
chunk stored when the ACK was answered, once and in order, then the live tail, with nothing twice."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.db import database_sync_to_async

from chat import broadcast
from chat import protocol as p
from chat.models import Conversation
from chat.wire.resume import REPLAY_PAGE_CHUNKS, ack_replay
from recovery.models import Fiber, Segment, Stream
from tests.chat.sockets import connected, new_name, receive_until

pytestmark = pytest.mark.django_db(transaction=True)

CHUNKS = 2 * REPLAY_PAGE_CHUNKS + 50  # three pages
SEGMENT = 7  # chunks per stored segment: pages end inside segments


def chunk(i: int) -> dict[str, Any]:
    return {"type": "text-delta", "id": "t1", "delta": f" {i}"}


def open_stream(conversation: Conversation, *, status: str = Fiber.Status.RUNNING) -> Stream:
    fiber = Fiber.objects.create(conversation=conversation, request_id="r1", status=status)
    return Stream.objects.create(conversation=conversation, fiber=fiber, request_id="r1", message_id="a1")


def store(stream: Stream, first: int, last: int) -> None:
    for start in range(first, last + 1, SEGMENT):
        end = min(start + SEGMENT - 1, last)
        body = "\n".join(json.dumps(chunk(i), separators=(",", ":")) for i in range(start, end + 1))
        Segment.objects.create(stream=stream, seq_start=start, seq_end=end, body=body, fencing=0)


def chunk_seqs(frames: list[dict[str, Any]]) -> list[int]:
    return [f["seq"] for f in frames if f["type"] == "cf_agent_use_chat_response" and f.get("body")]


def test_the_ack_reads_one_page_and_the_rest_up_to_what_was_stored() -> None:
    conversation = Conversation.objects.create(agent="assistant", name=new_name("pages"))
    stream = open_stream(conversation)
    store(stream, 0, CHUNKS - 1)
    replay = ack_replay(conversation_id=conversation.pk, request_id="r1")
    assert len(replay.frames) == REPLAY_PAGE_CHUNKS and replay.pages is not None
    assert replay.last_seq == CHUNKS - 1
    store(stream, CHUNKS, CHUNKS + 9)  # stored after the ACK: those reach the connection live
    frames = [json.loads(f) for f in replay.read_all()]
    assert chunk_seqs(frames) == list(range(CHUNKS))
    assert [json.loads(f["body"]) for f in frames[:-1]] == [chunk(i) for i in range(CHUNKS)]
    assert frames[-1]["replayComplete"] is True and all(f["replay"] for f in frames)


def test_a_finished_long_stream_ends_after_its_last_page() -> None:
    conversation = Conversation.objects.create(agent="assistant", name=new_name("pages"))
    stream = open_stream(conversation, status=Fiber.Status.COMPLETED)
    store(stream, 0, CHUNKS - 1)
    Stream.objects.filter(pk=stream.pk).update(status=Stream.Status.COMPLETED)
    frames = [json.loads(f) for f in ack_replay(conversation_id=conversation.pk, request_id="r1").read_all()]
    assert chunk_seqs(frames) == list(range(CHUNKS))
    assert frames[-1]["done"] is True and frames[-1]["seq"] == CHUNKS


async def test_a_connection_gets_every_page_then_the_live_tail_once() -> None:
    name = new_name("pages")
    async with connected(name) as socket:

        @database_sync_to_async
        def begin() -> tuple[int, Stream]:
            conversation = Conversation.objects.get(name=name)
            stream = open_stream(conversation)
            store(stream, 0, CHUNKS - 1)
            return conversation.pk, stream

        conversation_id, stream = await begin()
        await socket.send_to(text_data=json.dumps({"type": p.STREAM_RESUME_REQUEST}))
        await receive_until(socket, lambda f: f["type"] == "cf_agent_stream_resuming")
        await socket.send_to(text_data=json.dumps({"type": p.STREAM_RESUME_ACK, "id": "r1"}))
        replayed = await receive_until(socket, lambda f: f.get("replayComplete") is True)

        await database_sync_to_async(store)(stream, CHUNKS, CHUNKS + 4)
        late = [
            (i, p.response_frame("r1", json.dumps(chunk(i)), seq=i)) for i in range(CHUNKS - 3, CHUNKS + 5)
        ]
        await broadcast.publish_frames(conversation_id, "r1", late)  # three of them were replayed
        live = await receive_until(socket, lambda f: f.get("seq") == CHUNKS + 4)
    assert chunk_seqs(replayed) == list(range(CHUNKS))
    assert chunk_seqs(live) == list(range(CHUNKS, CHUNKS + 5)), "nothing twice, nothing missed"
