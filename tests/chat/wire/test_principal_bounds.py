"""What one principal may hold or ask of the web processes (issue 34, row 6): open sockets (and an
anonymous visitor's address), conversations owned, and replays of stored streams; each bound set low
here, each refusal clear and storing nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from unittest import mock

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from chat import protocol as p
from chat.access import conversation_open_as
from chat.caching import shared_redis
from chat.exceptions import ConversationLimit
from chat.models import Conversation
from chat.transcript import quotas, services
from chat.wire import limits
from chat.wire.limits import SOCKET_TTL_S, socket_slot_release, socket_slot_take
from recovery.models import Fiber, Segment, Stream
from tests.chat.sockets import APPLICATION, TIMEOUT_S, new_name, receive_until
from tests.chat.wire.test_limits import think
from tests.support import access_token


def someone() -> str:
    return f"test:{uuid.uuid4().hex[:10]}"


async def open_socket(principal: str, name: str) -> tuple[WebsocketCommunicator, dict[str, Any]]:
    """A socket as `principal`; its first output: a frame (accepted) or the close (refused)."""
    socket = WebsocketCommunicator(APPLICATION, f"/agents/assistant/{name}?token={access_token(principal)}")
    accepted, _ = await socket.connect(timeout=TIMEOUT_S)
    assert accepted
    return socket, await socket.receive_output(timeout=TIMEOUT_S)


@asynccontextmanager
async def sockets(principal: str, count: int) -> AsyncIterator[list[WebsocketCommunicator]]:
    opened = []
    try:
        for _ in range(count):
            socket, first = await open_socket(principal, new_name("bounds"))
            assert first["type"] == "websocket.send", first
            opened.append(socket)
        yield opened
    finally:
        for socket in opened:
            await socket.disconnect(timeout=TIMEOUT_S)


# -- open sockets ------------------------------------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
async def test_a_socket_beyond_the_principals_bound_is_closed_4429_and_one_closing_frees_a_place(
    settings: Any,
) -> None:
    settings.THINK = think(PRINCIPAL_MAX_SOCKETS=2)
    principal = someone()
    async with sockets(principal, 2) as opened:
        extra, first = await open_socket(principal, new_name("bounds"))
        assert first == {"type": "websocket.close", "code": 4429, "reason": mock.ANY}
        async with sockets(someone(), 1):  # another principal is not counted with them
            pass
        await opened.pop().disconnect(timeout=TIMEOUT_S)
        async with sockets(principal, 1):
            pass


@pytest.mark.django_db(transaction=True)
async def test_a_socket_takes_no_slot_when_the_bounds_are_lifted(settings: Any) -> None:
    settings.THINK = think(PRINCIPAL_MAX_SOCKETS=None)
    with mock.patch("chat.wire.consumers.socket_slot_take", side_effect=AssertionError("a slot taken")):
        async with sockets(someone(), 1):
            pass
    settings.THINK = think(PRINCIPAL_MAX_SOCKETS=2)
    with mock.patch("chat.wire.consumers.socket_slot_take", return_value="") as take:
        async with sockets(someone(), 1):
            pass
    assert take.call_count == 1, "bounded: the socket takes its slot"


@pytest.mark.django_db
def test_sockets_of_anonymous_visitors_are_also_counted_per_address(settings: Any) -> None:
    settings.THINK = think(ANONYMOUS_SOCKETS_PER_ADDRESS=2, PRINCIPAL_MAX_SOCKETS=5)
    address = f"10.{uuid.uuid4().int % 250}.0.{uuid.uuid4().int % 250}"
    for n in (1, 2):
        assert socket_slot_take(principal=f"session:{n}{address}", address=address, socket=f"s{n}") == ""
    refused = socket_slot_take(principal=f"session:3{address}", address=address, socket="s3")
    assert refused == "2 connections are already open from your address without signing in"
    assert socket_slot_take(principal=someone(), address=address, socket="s4") == "", "signed in: not counted"
    socket_slot_release(principal=f"session:1{address}", address=address, socket="s1")
    assert socket_slot_take(principal=f"session:3{address}", address=address, socket="s3") == ""


@pytest.mark.django_db
def test_the_slots_of_a_process_that_died_lapse(settings: Any) -> None:
    """A web process killed with its sockets open never releases their slots: they lapse unless renewed."""
    settings.THINK = think(PRINCIPAL_MAX_SOCKETS=2)
    principal, now = someone(), limits.time.time()
    for n in (1, 2):
        assert socket_slot_take(principal=principal, address=None, socket=f"dead{n}") == ""
    assert socket_slot_take(principal=principal, address=None, socket="new") != ""
    with mock.patch.object(limits.time, "time", return_value=now + SOCKET_TTL_S + 1):
        assert socket_slot_take(principal=principal, address=None, socket="new") == ""


@pytest.mark.django_db
def test_the_slots_are_counted_in_the_shared_cache_across_web_processes(settings: Any) -> None:
    """Every web process sees the same count: a principal's sockets on another process (here, one
    whose own process-local count is empty) still fill its slots."""
    settings.THINK = think(PRINCIPAL_MAX_SOCKETS=2)
    principal = someone()
    for n in (1, 2):
        assert socket_slot_take(principal=principal, address=None, socket=f"elsewhere{n}") == ""
    with mock.patch.object(limits, "_local", limits._LocalSlots()):  # another process's own memory
        assert socket_slot_take(principal=principal, address=None, socket="here") != ""


# -- conversations owned ----------------------------------------------------------------------------------
@pytest.mark.django_db
def test_a_new_conversation_beyond_the_bound_is_refused_and_no_row_is_made(settings: Any) -> None:
    settings.THINK = think(PRINCIPAL_MAX_CONVERSATIONS=2)
    principal = someone()
    names = [new_name("owned") for _ in range(3)]
    for name in names[:2]:
        conversation_open_as(agent="assistant", name=name, principal=principal)
    with pytest.raises(ConversationLimit, match="you already have 2 conversations"):
        conversation_open_as(agent="assistant", name=names[2], principal=principal)
    assert not Conversation.objects.filter(name=names[2]).exists()
    assert conversation_open_as(agent="assistant", name=names[0], principal=principal).owner == principal
    conversation_open_as(agent="assistant", name=names[2], principal=someone())  # someone else's count


@pytest.mark.django_db
def test_a_conversation_created_within_the_bound_is_the_row_stored(settings: Any) -> None:
    """The new conversation comes from one INSERT (chat.transcript.quotas): what it returns is what a
    read returns, and a name another connection created first is that one, not a refusal."""
    settings.THINK = think(PRINCIPAL_MAX_CONVERSATIONS=1)
    principal, name = someone(), new_name("owned")
    created = conversation_open_as(agent="assistant", name=name, principal=principal)
    stored = Conversation.objects.get(pk=created.pk)
    fields = [f.attname for f in Conversation._meta.concrete_fields]
    assert [getattr(created, f) for f in fields] == [getattr(stored, f) for f in fields]
    created.last_body = {"model": "m"}
    created.save(update_fields=["last_body"])  # a model instance as any other: it saves in place
    assert Conversation.objects.get(pk=created.pk).last_body == {"model": "m"}
    with mock.patch.object(quotas, "conversation_get", side_effect=[None, stored]):  # the race
        assert conversation_open_as(agent="assistant", name=name, principal=principal).pk == created.pk


@pytest.mark.django_db
def test_a_conversation_another_connection_created_first_keeps_its_owner(settings: Any) -> None:
    settings.THINK = think(PRINCIPAL_MAX_CONVERSATIONS=None)
    first, name = someone(), new_name("owned")
    created = conversation_open_as(agent="assistant", name=name, principal=first)
    assert Conversation.objects.get(pk=created.pk).owner == first
    with mock.patch.object(services, "conversation_get", return_value=None):  # it read before the insert
        again = services.conversation_get_or_create(agent="assistant", name=name, owner=someone())
    assert (again.pk, again.owner) == (created.pk, first)


@pytest.mark.django_db
def test_new_conversations_of_anonymous_visitors_are_counted_per_address(settings: Any) -> None:
    """Each cookie is a principal of its own; the address they come from is one."""
    settings.THINK = think(ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS=2)
    address = f"198.51.100.{uuid.uuid4().int % 250}-{uuid.uuid4().hex[:6]}"
    names = [new_name("anon") for _ in range(4)]
    for name in names[:2]:
        conversation_open_as(
            agent="assistant", name=name, principal=f"session:{uuid.uuid4().hex}", address=address
        )
    with pytest.raises(ConversationLimit, match="more than 2 new conversations an hour from your address"):
        conversation_open_as(
            agent="assistant", name=names[2], principal=f"session:{uuid.uuid4().hex}", address=address
        )
    assert not Conversation.objects.filter(name=names[2]).exists()
    owner = Conversation.objects.get(name=names[0]).owner
    assert (
        conversation_open_as(agent="assistant", name=names[0], principal=owner, address=address).owner
        == owner
    )
    conversation_open_as(agent="assistant", name=names[2], principal=someone(), address=address)  # signed in
    conversation_open_as(agent="assistant", name=names[3], principal="session:x", address=address + "-other")


@pytest.mark.django_db(transaction=True)
async def test_a_socket_to_a_name_beyond_the_bound_is_closed_4409(settings: Any) -> None:
    settings.THINK = think(PRINCIPAL_MAX_CONVERSATIONS=1)
    principal, mine, fresh = someone(), new_name("owned"), new_name("owned")
    await database_sync_to_async(conversation_open_as)(agent="assistant", name=mine, principal=principal)
    socket, first = await open_socket(principal, fresh)
    assert first == {"type": "websocket.close", "code": 4409, "reason": mock.ANY}
    assert not await Conversation.objects.filter(name=fresh).aexists()
    socket, first = await open_socket(principal, mine)
    assert first["type"] == "websocket.send"
    await socket.disconnect(timeout=TIMEOUT_S)


# -- replays -----------------------------------------------------------------------------------------------
@database_sync_to_async
def running_stream(principal: str, name: str) -> None:
    """A conversation of `principal` whose turn r1 streams: ten chunks stored."""
    conversation = Conversation.objects.create(agent="assistant", name=name, owner=principal)
    fiber = Fiber.objects.create(conversation=conversation, request_id="r1", status=Fiber.Status.RUNNING)
    stream = Stream.objects.create(conversation=conversation, fiber=fiber, request_id="r1", message_id="a1")
    chunks = [{"type": "text-delta", "id": "t1", "delta": f" {i}"} for i in range(10)]
    body = "\n".join(json.dumps(chunk, separators=(",", ":")) for chunk in chunks)
    Segment.objects.create(stream=stream, seq_start=0, seq_end=9, body=body, fencing=0)


async def send(socket: WebsocketCommunicator, frame: dict[str, Any]) -> None:
    await socket.send_to(text_data=json.dumps(frame))


async def offer(socket: WebsocketCommunicator) -> None:
    """A resume probe: answered by offering r1 (cf_agent_stream_resuming)."""
    await send(socket, {"type": p.STREAM_RESUME_REQUEST, "probeId": "offer"})
    [answer] = (await receive_until(socket, lambda f: f.get("probeId") == "offer"))[-1:]
    assert answer == {"type": p.STREAM_RESUMING, "id": "r1", "probeId": "offer"}


async def ack_answer(socket: WebsocketCommunicator) -> list[dict[str, Any]]:
    """What an ACK of r1 gets: the replay, or a refusal, or nothing; marked off by a branch switch that
    is refused after it (frames are handled in order)."""
    await send(socket, {"type": p.STREAM_RESUME_ACK, "id": "r1"})
    await send(socket, {"type": p.CHAT_BRANCH, "anchorId": "no-such-message", "index": 0})
    frames = await receive_until(socket, lambda f: f["type"] == p.CHAT_BRANCH_REFUSED)
    return frames[:-1]


@pytest.mark.django_db(transaction=True)
async def test_an_ack_for_a_stream_this_socket_was_never_offered_replays_nothing(settings: Any) -> None:
    principal, name = someone(), new_name("replay")
    await running_stream(principal, name)
    socket, first = await open_socket(principal, name)
    assert json.loads(first["text"]) == {"type": p.STREAM_RESUMING, "id": "r1"}, "offered on connect"
    await receive_until(socket, lambda f: f["type"] == "cf_agent_identity")
    assert len(await ack_answer(socket)) == 11, "the offered stream: ten chunks, then the live tail"
    assert await ack_answer(socket) == [], "one replay an offer"
    await offer(socket)
    assert len(await ack_answer(socket)) == 11
    other, _ = await open_socket(principal, new_name("replay"))  # a socket of another conversation
    await receive_until(other, lambda f: f["type"] == "cf_agent_identity")
    assert await ack_answer(other) == []
    for opened in (socket, other):
        await opened.disconnect(timeout=TIMEOUT_S)


@pytest.mark.django_db(transaction=True)
async def test_replays_beyond_the_principals_bound_are_refused(settings: Any) -> None:
    settings.THINK = think(PRINCIPAL_REPLAYS_PER_MINUTE=3)
    principal, name = someone(), new_name("replay")
    await running_stream(principal, name)
    socket, _ = await open_socket(principal, name)
    await receive_until(socket, lambda f: f["type"] == "cf_agent_identity")
    for _ in range(3):
        assert len(await ack_answer(socket)) == 11
        await offer(socket)
    [refusal] = await ack_answer(socket)
    assert refusal == {
        "type": p.USE_CHAT_RESPONSE,
        "id": "r1",
        "body": "Resume refused: more than 3 stream replays a minute; wait a moment",
        "done": True,
        "error": True,
    }
    await socket.disconnect(timeout=TIMEOUT_S)


@pytest.mark.django_db(transaction=True)
async def test_sockets_count_through_one_cache_client_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Django keeps a cache instance per async context, and each consumer is one: counted through it,
    every socket made a Redis pool and a connection of its own (chat.caching). Here none does."""
    import redis

    shared_redis().ping()  # the process's client, made before the sockets
    pools: list[Any] = []
    made = redis.ConnectionPool.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        pools.append(self)
        made(self, *args, **kwargs)

    monkeypatch.setattr(redis.ConnectionPool, "__init__", counted)
    sockets = [await open_socket(someone(), new_name("shared-cache")) for _ in range(3)]
    for socket, first in sockets:
        assert first["type"] != "websocket.close"
        await socket.disconnect()
    assert pools == [], f"{len(pools)} Redis pools made for 3 sockets"
