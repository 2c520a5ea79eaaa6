"""One durable streaming turn end to end: WebSocket client -> daphne -> Celery worker -> scripted model."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.models import Conversation, Message
from recovery.models import Fiber, Segment, Stream
from tests.support import (
    ChatClient,
    StreamLog,
    access_token,
    assistant_text,
    auth_headers,
    chat_request,
    follow_conversation,
    numbers,
    user_message,
    wait_logged,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def get_messages(port: int, name: str, agent: str = "assistant") -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/agents/{agent}/{name}/get-messages"
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def new_name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


async def start_turn(client: ChatClient, text: str) -> str:
    request_id = uuid.uuid4().hex[:8]
    await client.send(chat_request(request_id, [user_message(text)]))
    return request_id


async def test_count_to_50_streams_whole_and_persists(stack: Any) -> None:
    name = new_name()
    async with ChatClient(stack.port, name) as client:
        identity = await client.recv_type("cf_agent_identity")
        assert identity == {"type": "cf_agent_identity", "name": name, "agent": "assistant"}
        request_id = await start_turn(client, "count to 50")
        log = await client.follow(request_id, timeout=60)

    assert log.errors == []
    assert log.text == numbers(50)
    seqs = log.seqs
    assert seqs == list(range(len(seqs))), "seq must be contiguous from 0"
    assert log.done is not None and log.done["seq"] == len(seqs) and log.done["outcome"] == "completed"
    start = log.chunks[0][1]
    assert start["type"] == "start"
    types = [c["type"] for _, c in log.chunks]
    assert types[:3] == ["start", "start-step", "text-start"] and types[-3:] == [
        "text-end",
        "finish-step",
        "finish",
    ]

    transcript = await sync_to_async(get_messages)(stack.port, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert transcript[1]["id"] == start["messageId"], "start.messageId is the persisted id"
    assert assistant_text(transcript) == numbers(50)
    fiber = await Fiber.objects.aget(request_id=request_id)
    assert fiber.status == Fiber.Status.COMPLETED and fiber.fencing == 1 and fiber.lease_expires_at is None
    stream = await Stream.objects.aget(request_id=request_id)
    assert stream.status == Stream.Status.COMPLETED
    stored = [seq async for seq in Segment.objects.filter(stream=stream).values_list("seq_end", flat=True)]
    assert max(stored) == len(seqs) - 1


async def test_reconnect_mid_stream_replays_then_live_without_gap_or_duplicate(stack: Any) -> None:
    name = new_name()
    async with ChatClient(stack.port, name) as first:
        request_id = await start_turn(first, "count to 120 [rate 40]")
        partial = await first.follow(request_id, stop_after=8, timeout=30)
        assert partial.done is None
    async with ChatClient(stack.port, name) as second:
        resuming = await second.recv_type("cf_agent_stream_resuming")
        assert resuming["id"] == request_id
        await second.send({"type": "cf_agent_stream_resume_request", "probeId": "p1"})
        answer = await second.recv_type("cf_agent_stream_resuming")
        assert answer == {"type": "cf_agent_stream_resuming", "id": request_id, "probeId": "p1"}
        await second.send({"type": "cf_agent_stream_resume_ack", "id": request_id})
        log = StreamLog()
        replayed = 0
        while log.done is None:
            frame = await second.recv(timeout=30)
            if frame.get("type") != "cf_agent_use_chat_response":
                continue
            if frame.get("replayComplete"):
                assert replayed > 0
                continue
            if frame.get("replay") and not frame.get("done"):
                replayed += 1
            if frame.get("body"):
                log.chunks.append((frame.get("seq"), json.loads(frame["body"])))
            if frame.get("done"):
                log.done = frame
    assert replayed >= len(partial.chunks), "the replay holds at least what the first client saw"
    assert log.seqs == list(range(len(log.seqs)))
    assert log.text == numbers(120)


async def test_second_delivery_of_a_finished_turn_writes_nothing(stack: Any) -> None:
    from chat.tasks import run_turn

    name = new_name()
    async with ChatClient(stack.port, name) as client:
        request_id = await start_turn(client, "count to 10")
        await client.follow(request_id, timeout=30)
    fiber = await Fiber.objects.aget(request_id=request_id)
    before = (await Segment.objects.acount(), await Message.objects.acount(), fiber.fencing)

    await sync_to_async(run_turn.delay)(str(fiber.pk))
    # The worker took the second delivery and found nothing to claim (chat.turn.runner logs it).
    await asyncio.to_thread(wait_logged, stack.workers[0], f"fiber {fiber.pk} not claimed")

    await fiber.arefresh_from_db()
    assert (await Segment.objects.acount(), await Message.objects.acount(), fiber.fencing) == before
    assert fiber.status == Fiber.Status.COMPLETED


async def test_duplicate_delivery_while_running_is_a_no_op(stack: Any) -> None:
    from chat.tasks import run_turn

    name = new_name()
    async with ChatClient(stack.port, name) as client:
        request_id = await start_turn(client, "count to 40 [rate 40]")
        await client.follow(request_id, stop_after=5, timeout=30)
        fiber = await Fiber.objects.aget(request_id=request_id)
        await sync_to_async(run_turn.delay)(str(fiber.pk))
        log = await client.follow(request_id, timeout=60)
    await fiber.arefresh_from_db()
    assert fiber.fencing == 1, "the second delivery must not claim the fiber"
    assert await Stream.objects.filter(fiber=fiber).acount() == 1
    assert log.done is not None and log.done["outcome"] == "completed"
    transcript = await sync_to_async(get_messages)(stack.port, name)
    assert assistant_text(transcript) == numbers(40)


async def test_cancel_stops_the_turn_and_keeps_the_partial(stack: Any) -> None:
    name = new_name()
    async with ChatClient(stack.port, name) as client:
        request_id = await start_turn(client, "count to 300 [rate 30]")
        log = await client.follow(request_id, stop_after=8, timeout=30)
        await client.send({"type": "cf_agent_chat_request_cancel", "id": request_id})
        await client.follow(request_id, log, timeout=30)
    assert log.done is not None and not log.done.get("error") and log.done["outcome"] == "aborted"
    assert log.text and numbers(300).startswith(log.text) and len(log.text) < len(numbers(300))
    fiber = await Fiber.objects.aget(request_id=request_id)
    assert fiber.status == Fiber.Status.CANCELLED
    transcript = await sync_to_async(get_messages)(stack.port, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert assistant_text(transcript) == log.text, "the persisted partial is exactly what the client saw"


async def test_disconnect_does_not_stop_the_turn(stack: Any) -> None:
    name = new_name()
    async with ChatClient(stack.port, name) as client:
        request_id = await start_turn(client, "count to 30 [rate 60]")
        await client.follow(request_id, stop_after=3, timeout=30)
    fiber = await Fiber.objects.aget(request_id=request_id)

    async def finished() -> bool:
        await fiber.arefresh_from_db()
        return fiber.status == Fiber.Status.COMPLETED

    for _ in range(300):
        if await finished():
            break
        await asyncio.sleep(0.1)
    assert fiber.status == Fiber.Status.COMPLETED
    transcript = await sync_to_async(get_messages)(stack.port, name)
    assert assistant_text(transcript) == numbers(30)


async def test_malformed_and_unknown_frames_are_ignored_without_closing(stack: Any) -> None:
    name = new_name()
    async with ChatClient(stack.port, name) as client:
        await client.recv_type("cf_agent_identity")
        for junk in [
            "not json",
            "[1, 2]",
            "{}",
            '{"type": "no_such_type"}',
            '{"type": 42}',
            '{"type": "cf_agent_stream_resume_ack"}',
            '{"type": "cf_agent_chat_request_cancel", "id": 7}',
        ]:
            await client.send(junk)
        bad = {"type": "cf_agent_use_chat_request", "id": "bad1", "init": {"method": "POST", "body": "{oops"}}
        await client.send(bad)
        error = await client.recv_type("cf_agent_use_chat_response")
        assert (
            error["id"] == "bad1"
            and error["done"]
            and error["error"]
            and "Invalid chat request" in error["body"]
        )
        await client.send({"type": "cf_agent_stream_resume_request", "probeId": "still-here"})
        answer = await client.recv_type("cf_agent_stream_resume_none")
        assert answer == {"type": "cf_agent_stream_resume_none", "reason": "idle", "probeId": "still-here"}
    conversation = await Conversation.objects.aget(name=name)
    assert await Message.objects.filter(conversation=conversation).acount() == 0
    assert await Fiber.objects.filter(conversation=conversation).acount() == 0


async def test_unknown_agent_is_refused_with_a_4xxx_close_code(stack: Any) -> None:
    import websockets

    url = f"ws://127.0.0.1:{stack.port}/agents/no-such-agent/x"
    async with websockets.connect(url, origin=f"http://127.0.0.1:{stack.port}") as ws:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404
    with pytest.raises(urllib.error.HTTPError) as http_error:
        await sync_to_async(get_messages)(stack.port, "x", agent="no-such-agent")
    assert http_error.value.code == 404


async def test_clear_wipes_the_conversation_and_tells_other_tabs(stack: Any) -> None:
    name = new_name()
    async with ChatClient(stack.port, name) as tab1, ChatClient(stack.port, name) as tab2:
        request_id = await start_turn(tab1, "count to 5")
        await tab1.follow(request_id, timeout=30)
        await tab2.send({"type": "cf_agent_chat_clear"})
        cleared = await tab1.recv_type("cf_agent_chat_clear")
        assert cleared == {"type": "cf_agent_chat_clear"}
    assert await sync_to_async(get_messages)(stack.port, name) == []
    assert await Stream.objects.filter(conversation__name=name).acount() == 0


async def test_other_tab_observes_the_turn(stack: Any) -> None:
    name = new_name()
    async with ChatClient(stack.port, name) as tab1, ChatClient(stack.port, name) as tab2:
        await tab2.recv_type("cf_agent_identity")  # after the transcript sent on connect
        request_id = await start_turn(tab1, "count to 12")
        # Everything tab2 gets from now on is kept: the pushed user message and the stream may arrive
        # in either order on a busy machine, and neither may be dropped while waiting for the other.
        other = await follow_conversation(tab2, timeout=30)
        own = await tab1.follow(request_id, timeout=30)
    assert other.messages and [m["role"] for m in other.messages[0]] == ["user"]
    seen = other.streams[request_id]
    assert seen.text == own.text == numbers(12)
    assert seen.seqs == own.seqs


async def test_a_finished_turn_is_idle_to_a_resume_probe(stack: Any) -> None:
    name = new_name()
    async with ChatClient(stack.port, name) as client:
        request_id = await start_turn(client, "count to 3")
        await client.follow(request_id, timeout=30)
    async with ChatClient(stack.port, name) as later:
        messages = await later.recv_type("cf_agent_chat_messages")
        assert assistant_text(messages["messages"]) == numbers(3)
        await later.send({"type": "cf_agent_stream_resume_request", "probeId": "q"})
        assert await later.recv_type("cf_agent_stream_resume_none") == {
            "type": "cf_agent_stream_resume_none",
            "reason": "idle",
            "probeId": "q",
        }


async def test_clients_without_an_origin_are_accepted_and_foreign_origins_refused(stack: Any) -> None:
    """Node and server-side clients send no Origin (the published agents client among them); a page on
    another site does, and is refused, so it cannot ride a visitor's cookies (CSWSH)."""
    import websockets

    url = f"ws://127.0.0.1:{stack.port}/agents/assistant/{new_name()}?token={access_token()}"
    async with websockets.connect(url) as ws:  # no Origin header at all (and a token: no cookie either)
        frames = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(2)]
    assert frames[-1]["type"] == "cf_agent_identity"
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(url, origin="http://evil.example"):
            pass
    assert refused.value.response.status_code == 403


@pytest.mark.parametrize(("agent", "client"), [("assistant", "aiohttp"), ("litellm-read-agent", "OpenAI")])
async def test_a_turn_streams_through_either_model_read(
    stack: Any, scripted_model: Any, agent: str, client: str
) -> None:
    """The lean read (the default) and litellm's read (Think.lean_model_read = False) give one answer."""
    name = new_name()
    async with ChatClient(stack.port, name, agent) as ws:
        request_id = await start_turn(ws, f"count to 25 {name}")
        log = await ws.follow(request_id, timeout=30)
    assert log.done is not None and log.done["outcome"] == "completed"
    assert log.text == numbers(25)
    [seen] = [
        c
        for body, c in zip(scripted_model.requests, scripted_model.clients, strict=True)
        if name in json.dumps(body)
    ]
    assert client in seen, f"the model was read by {seen!r}"
    stored = await sync_to_async(get_messages)(stack.port, name, agent)
    assert assistant_text(stored) == numbers(25)
