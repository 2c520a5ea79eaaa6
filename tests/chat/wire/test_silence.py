"""A connection following a live stream that falls silent fills it from Postgres (chat.wire.silence).

The "worker" here stores chunks and publishes frames by hand, and leaves frames out on purpose: the
tail of a stream, and its end. The consumer runs in-process on the real channel layer and database.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.conf import settings as django_settings

from chat import broadcast
from chat import protocol as p
from chat.models import Conversation, Message
from recovery.models import Fiber, Segment, Stream
from tests.chat.sockets import Frame, connected, new_name, receive_until

pytestmark = pytest.mark.django_db(transaction=True)

SILENCE_MS = 300


@pytest.fixture(autouse=True)
def quick_silence(settings: Any) -> None:
    settings.THINK = {**django_settings.THINK, "STREAM_SILENCE_MS": SILENCE_MS}


def chunk(i: int) -> dict[str, Any]:
    return {"type": "text-delta", "id": "t1", "delta": f" {i}"}


@database_sync_to_async
def open_stream(name: str) -> tuple[int, Stream]:
    conversation = Conversation.objects.get(name=name)
    fiber = Fiber.objects.create(conversation=conversation, request_id="r1", status=Fiber.Status.RUNNING)
    stream = Stream.objects.create(conversation=conversation, fiber=fiber, request_id="r1", message_id="a1")
    return conversation.pk, stream


@database_sync_to_async
def store(stream: Stream, first: int, last: int) -> None:
    body = "\n".join(json.dumps(chunk(i), separators=(",", ":")) for i in range(first, last + 1))
    Segment.objects.create(stream=stream, seq_start=first, seq_end=last, body=body, fencing=0)


@database_sync_to_async
def finish(stream: Stream) -> None:
    """The turn's end as the store sees it: the message, the stream and the fiber closed."""
    parts = [{"type": "text", "text": "".join(chunk(i)["delta"] for i in range(10)), "state": "done"}]
    Message.objects.create(
        conversation_id=stream.conversation_id, message_id="a1", role="assistant", parts=parts, position=0
    )
    Stream.objects.filter(pk=stream.pk).update(status=Stream.Status.COMPLETED)
    Fiber.objects.filter(pk=stream.fiber_id).update(status=Fiber.Status.COMPLETED)


async def publish(conversation_id: int, first: int, last: int) -> None:
    frames = [(i, p.response_frame("r1", json.dumps(chunk(i)), seq=i)) for i in range(first, last + 1)]
    await broadcast.publish_frames(conversation_id, "r1", frames)


def seqs(frames: list[Frame]) -> list[int]:
    return [f["seq"] for f in frames if f["type"] == "cf_agent_use_chat_response" and f.get("id") == "r1"]


async def test_a_lost_tail_and_end_are_filled_from_the_store() -> None:
    name = new_name("silence")
    async with connected(name) as socket:
        conversation_id, stream = await open_stream(name)
        await store(stream, 0, 9)
        await publish(conversation_id, 0, 4)  # 5..9 and the end frame are lost
        live = await receive_until(socket, lambda f: f.get("seq") == 4)
        await finish(stream)
        filled = await receive_until(socket, lambda f: f["type"] == "cf_agent_chat_messages", timeout=5)
    assert seqs(live) == [0, 1, 2, 3, 4]
    responses = [f for f in filled if f["type"] == "cf_agent_use_chat_response"]
    assert seqs(filled) == [5, 6, 7, 8, 9, 10], "the lost chunks, then the end frame after them"
    assert [json.loads(f["body"]) for f in responses[:-1]] == [chunk(i) for i in range(5, 10)]
    end = responses[-1]
    assert end["done"] is True and end["outcome"] == "completed" and not end.get("error")
    assert filled[-1]["messages"][0]["id"] == "a1", "then the stored transcript, as after a live end"


async def test_a_quiet_stream_is_filled_once_and_the_live_tail_follows_without_duplicates() -> None:
    name = new_name("silence")
    async with connected(name) as socket:
        conversation_id, stream = await open_stream(name)
        await store(stream, 0, 6)
        await publish(conversation_id, 0, 2)  # 3..6 are lost; the stream goes on
        first = await receive_until(socket, lambda f: f.get("seq") == 6, timeout=5)
        await asyncio.sleep(SILENCE_MS / 1000 * 3)  # quiet in the store too: nothing more is sent
        await store(stream, 7, 9)
        await publish(conversation_id, 5, 9)  # 5 and 6 again (a slow publish): already sent
        rest = await receive_until(socket, lambda f: f.get("seq") == 9, timeout=5)
        end = p.response_frame("r1", done=True, seq=10, outcome="completed")
        await broadcast.publish_stream_end(conversation_id, "r1", 10, end)
        await finish(stream)
        done = await receive_until(socket, lambda f: f.get("done") is True, timeout=5)
        await asyncio.sleep(SILENCE_MS / 1000 * 3)
        after = []
        while not await socket.receive_nothing(timeout=0.1):
            after.append(json.loads((await socket.receive_output())["text"]))
    assert seqs(first) == [0, 1, 2, 3, 4, 5, 6]
    assert seqs(rest) == [7, 8, 9], "nothing sent twice"
    assert seqs(done) == [10]
    assert after == [], "a stream that ended live is no longer looked at"


@database_sync_to_async
def fail(stream: Stream) -> None:
    Conversation.objects.filter(pk=stream.conversation_id).update(
        last_terminal={"requestId": "r1", "body": "The model failed."}
    )
    Stream.objects.filter(pk=stream.pk).update(status=Stream.Status.ERROR)
    Fiber.objects.filter(pk=stream.fiber_id).update(status=Fiber.Status.FAILED)


async def test_the_lost_end_of_a_failed_turn_is_its_recorded_error() -> None:
    name = new_name("silence")
    async with connected(name) as socket:
        conversation_id, stream = await open_stream(name)
        await store(stream, 0, 2)
        await publish(conversation_id, 0, 2)
        await receive_until(socket, lambda f: f.get("seq") == 2)
        await fail(stream)  # its error frame is lost
        filled = await receive_until(socket, lambda f: f["type"] == "cf_agent_chat_messages", timeout=5)
    [end] = [f for f in filled if f["type"] == "cf_agent_use_chat_response"]
    assert end == {
        **end,
        "seq": 3,
        "done": True,
        "error": True,
        "body": "The model failed.",
        "outcome": "error",
    }


@pytest.mark.parametrize("value", [0, -1, "2000", None])
def test_the_silence_must_be_a_positive_number(settings: Any, value: Any) -> None:
    from chat.checks import check_think_settings

    settings.THINK = {**django_settings.THINK, "STREAM_SILENCE_MS": value}
    assert [error.id for error in check_think_settings()] == ["think_chat.E005"]


async def test_live_frames_reach_the_socket_without_a_thread_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-frame path of the web process: a group event of streamed frames is forwarded as it is,
    with no database, cache or thread call per event (Channels' dispatch hops to its sync thread before
    every message; chat.wire.consumers.ChatConsumer.dispatch does not)."""
    name = new_name("silence")
    async with connected(name) as socket:
        conversation_id, stream = await open_stream(name)
        await store(stream, 0, 19)
        loop = asyncio.get_running_loop()
        hops: list[Any] = []
        run_in_executor = loop.run_in_executor

        def counted(executor: Any, fn: Any, *args: Any) -> Any:
            hops.append(fn)
            return run_in_executor(executor, fn, *args)

        monkeypatch.setattr(loop, "run_in_executor", counted)
        for i in range(20):  # one event each, as a flusher tick of one turn sends them
            await publish(conversation_id, i, i)
        frames = await receive_until(socket, lambda f: f.get("seq") == 19)
        monkeypatch.undo()
    assert seqs(frames) == list(range(20))
    assert hops == [], f"{len(hops)} thread hops for 20 events"


async def test_a_closed_socket_ends_without_a_hop_to_the_sync_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Channels' websocket_disconnect ends with `aclose_old_connections`, a hop to the process's one sync
    thread per closed socket; the consumer's own runs its `disconnect` (the group left, the slot given
    back) and nothing else."""
    import channels.generic.websocket as generic

    from chat.wire.consumers import ChatConsumer

    checks: list[str] = []
    disconnects: list[int] = []

    async def aclose_old_connections() -> None:
        checks.append("sync thread")

    real_disconnect = ChatConsumer.disconnect

    async def disconnect(self: ChatConsumer, code: int) -> None:
        disconnects.append(code)
        await real_disconnect(self, code)

    monkeypatch.setattr(generic, "aclose_old_connections", aclose_old_connections)
    monkeypatch.setattr(ChatConsumer, "disconnect", disconnect)
    async with connected(new_name("closed")):
        pass
    assert disconnects == [1000]
    assert checks == []
