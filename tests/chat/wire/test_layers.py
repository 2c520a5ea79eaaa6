"""chat.wire.layers.RedisFanoutLayer on the real Redis, and what the web process does with it: a
transcript is read for the other tabs of a conversation only when there are some."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from django.conf import settings

from chat import broadcast
from chat.wire.layers import RedisFanoutLayer
from tests.chat.sockets import connected, new_name, receive_until
from tests.support import chat_request, user_message


def a_layer() -> RedisFanoutLayer:
    """A layer as another web process has it: its own subscriptions, the same Redis."""
    return RedisFanoutLayer(**settings.CHANNEL_LAYERS["default"]["CONFIG"])


async def test_a_group_has_others_here_or_in_another_process() -> None:
    here, elsewhere = a_layer(), a_layer()
    group = f"test.others.{uuid.uuid4().hex[:8]}"
    mine, theirs = await here.new_channel(), await elsewhere.new_channel()
    try:
        assert not await here.group_has_others(group, [])
        await here.group_add(group, mine)
        assert await here.group_has_others(group, [])
        assert not await here.group_has_others(group, [mine]), "the sender alone"
        await elsewhere.group_add(group, theirs)
        assert await here.group_has_others(group, [mine]), "a socket of another process"
        await elsewhere.group_discard(group, theirs)
        assert not await here.group_has_others(group, [mine])
        await here.group_discard(group, mine)
        assert await elsewhere.group_has_others(group, []) is False
    finally:
        await here.flush()
        await elsewhere.flush()


@pytest.fixture
def quiet_broker(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import chat.transcript.turns

    sent: list[Any] = []
    monkeypatch.setattr(chat.transcript.turns, "turn_send", sent.append)
    return sent


@pytest.mark.django_db(transaction=True)
async def test_an_accept_reads_the_transcript_for_other_tabs_only(
    quiet_broker: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    read = broadcast.transcript_frame

    def counted(*, conversation_id: int) -> str:
        reads.append(conversation_id)
        return read(conversation_id=conversation_id)

    monkeypatch.setattr(broadcast, "transcript_frame", counted)
    monkeypatch.setattr(broadcast, "_heard_by_others", _spy(broadcast._heard_by_others, asked := []))
    name = new_name("tabs")
    async with connected(name) as alone:
        await alone.send_to(text_data=chat_request("r-alone", [user_message("one")]))
        await _until(lambda: asked)
    assert asked == [False] and reads == [], "one socket, the sender's: nothing read"
    async with connected(name) as sender, connected(name) as other:
        await sender.send_to(text_data=chat_request("r-tabs", [user_message("two")]))
        frames = await receive_until(other, lambda f: f["type"] == "cf_agent_chat_messages")
    assert asked[-1] is True and len(reads) == 1
    assert [m["parts"][0]["text"] for m in frames[-1]["messages"]][-1] == "two", "the other tab saw it"
    assert len(quiet_broker) == 1, "the second turn waits behind the first, never claimed here"


def _spy(fn: Any, answers: list[bool]) -> Any:
    async def spied(*args: Any) -> bool:
        answer = await fn(*args)
        answers.append(answer)
        return answer

    return spied


async def _until(done: Any, timeout: float = 5) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


@pytest.mark.django_db(transaction=True)
async def test_the_other_tabs_hear_of_an_accepted_turn_before_a_worker_can_start_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transcript an accept sends the other tabs is published before the turn goes to a worker: a
    short answer published first would otherwise be wiped from their screens by this older copy (seen
    in tests/e2e/test_react_hook.py::test_two_tabs_follow_one_conversation under load)."""
    import chat.transcript.turns

    order: list[str] = []
    publish = broadcast.publish_sync

    def published(conversation_id: int, frame: str, **kwargs: Any) -> None:
        order.append("transcript" if '"cf_agent_chat_messages"' in frame else "other")
        publish(conversation_id, frame, **kwargs)

    monkeypatch.setattr(broadcast, "publish_sync", published)
    monkeypatch.setattr(chat.transcript.turns, "turn_send", lambda fiber_id: order.append("sent"))
    name = new_name("order")
    async with connected(name) as sender, connected(name) as other:
        await sender.send_to(text_data=chat_request("r-order", [user_message("one")]))
        await receive_until(other, lambda f: f["type"] == "cf_agent_chat_messages")
        await _until(lambda: "sent" in order)
    assert order == ["transcript", "sent"]
