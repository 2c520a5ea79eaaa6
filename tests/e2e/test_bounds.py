"""Bounds on what one client can make the server do (issue 34), each attacked over a real daphne."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.models import Conversation, Message
from recovery.models import Fiber
from tests.support import ChatClient, chat_request, numbers, start_daphne, user_message

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def new_name(prefix: str = "b") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def test_a_request_of_15000_new_messages_is_refused_and_another_visitor_is_answered(stack: Any) -> None:
    """A ~750 KB frame of 15,000 empty user messages (under the frame limit) asks for 15,000 rows on the
    web process's one database thread. It is refused whole (MAX_NEW_MESSAGES), nothing stored, and a
    second visitor's turn is answered."""
    attack_name, other_name = new_name("flood"), new_name("other")
    messages = [{"id": f"m{n:05}", "role": "user", "parts": []} for n in range(15_000)]
    frame = chat_request("flood", messages)
    assert 700_000 < len(frame.encode()) < 1_000_000
    async with ChatClient(stack.port, attack_name) as attacker, ChatClient(stack.port, other_name) as other:
        await attacker.recv_type("cf_agent_identity")
        await other.recv_type("cf_agent_identity")
        await attacker.send(frame)
        await other.send(chat_request("count", [user_message("count to 5")]))
        refusal = await attacker.follow("flood", timeout=30)
        answer = await other.follow("count", timeout=60)
    assert refusal.errors == [
        "Chat request refused: it adds 15000 new messages, more than the 100 one request may add;"
        " send them in smaller requests"
    ]
    assert answer.errors == [] and answer.text == numbers(5)
    conversation = await Conversation.objects.aget(name=attack_name)
    assert not await Message.objects.filter(conversation=conversation).aexists()
    assert not await Fiber.objects.filter(conversation=conversation).aexists()


# -- per principal: sockets, conversations, replays (row 6) -------------------------------------------------
@pytest.fixture(scope="module")
def bounded(stack: Any, log_dir: Path) -> Iterator[int]:
    """A daphne of the shared stack with low per-principal bounds (the shared worker runs its turns)."""
    env = {
        "THINK_PRINCIPAL_MAX_SOCKETS": "3",
        "THINK_PRINCIPAL_MAX_CONVERSATIONS": "3",
        "THINK_PRINCIPAL_REPLAYS_PER_MINUTE": "3",
        "THINK_ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS": "3",
    }
    daphne, port = start_daphne({**stack.env, **env}, log_dir)
    yield port
    daphne.stop()


def someone() -> str:
    return f"test:{uuid.uuid4().hex[:10]}"


async def test_a_socket_beyond_the_principals_bound_is_closed_4429(bounded: int) -> None:
    principal, name = someone(), new_name("sockets")
    clients = [ChatClient(bounded, name, principal=principal) for _ in range(4)]
    for client in clients[:3]:
        await client.__aenter__()
        await client.recv_type("cf_agent_identity")
    try:
        async with clients[3] as extra:
            assert await extra.close_code() == 4429
            assert extra.frames == []
        async with ChatClient(bounded, new_name("other"), principal=someone()) as other:  # not counted
            await other.recv_type("cf_agent_identity")
        await clients[0].__aexit__()
        await clients[0].ws.wait_closed()
        async with ChatClient(bounded, name, principal=principal) as again:  # a place was freed
            await again.recv_type("cf_agent_identity", timeout=10)
    finally:
        for client in clients[1:3]:
            await client.__aexit__()


async def test_fresh_names_beyond_the_principals_bound_are_closed_4409_with_no_row(bounded: int) -> None:
    principal = someone()
    names = [new_name("owned") for _ in range(5)]
    for name in names[:3]:
        async with ChatClient(bounded, name, principal=principal) as client:
            await client.recv_type("cf_agent_identity")
    for name in names[3:]:
        async with ChatClient(bounded, name, principal=principal) as client:
            assert await client.close_code() == 4409
    assert not await Conversation.objects.filter(name__in=names[3:]).aexists()
    assert await Conversation.objects.filter(owner=principal).acount() == 3
    async with ChatClient(bounded, names[0], principal=principal) as client:  # theirs still open
        await client.recv_type("cf_agent_identity")


async def test_fresh_cookies_do_not_lift_the_bound_on_new_conversations(bounded: int) -> None:
    """A new cookie is a new anonymous principal, each with PRINCIPAL_MAX_CONVERSATIONS of its own: a loop
    of "get a cookie, connect to a fresh name" would add rows without end. New conversations of anonymous
    visitors are also counted per client address (3 an hour here): the 4th is closed 4409, no row."""
    names = [new_name("anon") for _ in range(5)]
    cookies = []
    for name in names:
        cookie = await sync_to_async(fresh_cookie)(bounded)
        cookies.append(cookie)
        async with ChatClient(bounded, name, principal=None, cookie=cookie) as client:
            if len(cookies) <= 3:
                await client.recv_type("cf_agent_identity")
            else:
                assert await client.close_code() == 4409
                assert client.frames == []
    assert await Conversation.objects.filter(name__in=names[:3]).acount() == 3
    assert not await Conversation.objects.filter(name__in=names[3:]).aexists()
    async with ChatClient(bounded, names[0], principal=None, cookie=cookies[0]) as client:  # theirs opens
        await client.recv_type("cf_agent_identity")
    async with ChatClient(bounded, new_name("signed"), principal=someone()) as client:  # not anonymous
        await client.recv_type("cf_agent_identity")


def fresh_cookie(port: int) -> str:
    """What a cookie-less visit to the page hands out: a new session, a new anonymous principal."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
        cookies = response.headers.get_all("Set-Cookie") or []
    return next(c.split(";")[0] for c in cookies if c.startswith("sessionid="))


async def replay_answer(client: ChatClient, request_id: str) -> list[dict[str, Any]]:
    """The frames an ACK gets, marked off by a branch switch refused after it (frames run in order)."""
    await client.send({"type": "cf_agent_stream_resume_ack", "id": request_id})
    await client.send({"type": "cf_agent_chat_branch", "anchorId": "no-such-message", "index": 0})
    before = len(client.frames)
    await client.recv_type("cf_agent_chat_branch_refused")
    return [f for f in client.frames[before:-1] if f.get("id") == request_id]


async def test_an_ack_loop_replays_only_offered_streams_and_stops_at_the_bound(bounded: int) -> None:
    """ACKs for a finished stream never offered replay nothing; a stream offered again and again (a
    probe before each ACK, while it runs) is replayed PRINCIPAL_REPLAYS_PER_MINUTE times, then refused."""
    principal, name = someone(), new_name("replays")
    async with ChatClient(bounded, name, principal=principal) as client:
        await client.recv_type("cf_agent_identity")
        await client.send(chat_request("done", [user_message("count to 30")]))
        await client.follow("done", timeout=60)
        for _ in range(5):  # finished, and this socket was never offered it
            assert await replay_answer(client, "done") == []
        await client.send(chat_request("slow", [user_message("count to 400 [rate 25]")]))
        await client.follow("slow", stop_after=3, timeout=60)
        replays = []
        for n in range(5):
            await client.send({"type": "cf_agent_stream_resume_request", "probeId": f"p{n}"})
            offer = await client.recv_type("cf_agent_stream_resuming")
            assert offer["id"] == "slow"
            replays.append(await replay_answer(client, "slow"))
        await client.send({"type": "cf_agent_chat_stop"})
    assert all(any(f.get("replay") for f in frames) for frames in replays[:3]), "three replays"
    for frames in replays[3:]:
        assert not any(f.get("replay") for f in frames)
        assert [f["body"] for f in frames if f.get("error")] == [
            "Resume refused: more than 3 stream replays a minute; wait a moment"
        ]
