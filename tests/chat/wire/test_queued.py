"""A turn accepted but unable to start tells its clients so (cf_agent_chat_queued, docs/protocol.md):
at once when it waits behind a turn of its own conversation, after THINK["QUEUED_NOTICE_MS"] when no
worker has taken it, and never when a worker took it in time.

The consumer runs in-process on the real channel layer and database; nothing reaches the broker
(the turns are recorded instead), so no worker ever claims them unless a test does it by hand.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.conf import settings as django_settings

from chat import broadcast
from chat import protocol as p
from chat.checks import check_think_settings
from chat.models import Conversation
from recovery.models import Fiber, Stream
from tests.chat.sockets import Frame, connected, new_name, receive_until
from tests.support import chat_request, row_locked_elsewhere, user_message

pytestmark = pytest.mark.django_db(transaction=True)

NOTICE_MS = 300


@pytest.fixture
def quiet_broker(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """The turns sent to the workers, recorded instead of reaching the broker."""
    import chat.transcript.turns

    sent: dict[str, list[Any]] = {"turns": []}
    monkeypatch.setattr(chat.transcript.turns, "turn_send", sent["turns"].append)
    return sent


@pytest.fixture(autouse=True)
def quick_notice(settings: Any) -> None:
    settings.THINK = {**django_settings.THINK, "QUEUED_NOTICE_MS": NOTICE_MS}


def queued(request_id: str) -> Any:
    return lambda frame: frame["type"] == p.CHAT_QUEUED and frame.get("id") == request_id


def waits_for_workers(request_id: str) -> Any:
    """Its notice once it is accepted (before, a slow accept is told "server")."""
    return lambda frame: queued(request_id)(frame) and frame["reason"] == p.QUEUED_FOR_WORKER


async def frames_for(communicator: Any, seconds: float) -> list[Frame]:
    """Every frame the client gets within `seconds`."""
    frames: list[Frame] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        # receive_output's timeout would end the application: ask for nothing first.
        if await communicator.receive_nothing(timeout=0.05):
            continue
        message = await communicator.receive_output(timeout=1)
        frames.append(json.loads(message["text"]))
    return frames


async def claim_by_hand(request_id: str, *, start: bool = True) -> None:
    """What a worker's claim does to the fiber, as far as the notice can tell (once it exists), and, with
    `start`, the stream it opens right after (a worker too busy to begin has not opened it yet)."""
    running = Fiber.objects.filter(request_id=request_id)
    for _ in range(100):
        if await database_sync_to_async(running.update)(status=Fiber.Status.RUNNING):
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"no fiber for {request_id}")
    if start:  # what a worker does once it has begun: the stream opened, and the event that says so
        fiber = await database_sync_to_async(running.get)()
        await database_sync_to_async(Stream.objects.create)(
            conversation_id=fiber.conversation_id,
            fiber=fiber,
            request_id=request_id,
            message_id="a-" + request_id,
        )
        await broadcast.publish_stream_started(fiber.conversation_id, request_id)


async def test_a_turn_no_worker_takes_is_reported_waiting_for_a_worker(quiet_broker: Any) -> None:
    async with connected(new_name()) as client:
        await client.send_to(text_data=chat_request("r-first", [user_message("hello")]))
        started = asyncio.get_running_loop().time()
        frames = await receive_until(client, queued("r-first"), timeout=5)
        waited = asyncio.get_running_loop().time() - started
    frame = frames[-1]
    assert frame == {"type": p.CHAT_QUEUED, "id": "r-first", "reason": "workers"}
    assert waited >= NOTICE_MS / 1000 * 0.9, "not before the notice delay"
    assert len(quiet_broker["turns"]) == 1, "the turn was accepted and sent"


async def test_a_turn_behind_another_of_its_conversation_is_reported_at_once(
    quiet_broker: Any, settings: Any
) -> None:
    settings.THINK = {**settings.THINK, "QUEUED_NOTICE_MS": 2000}  # "at once" is well before it
    first, second = user_message("one"), user_message("two")
    async with connected(new_name()) as client:
        await client.send_to(text_data=chat_request("r-1", [first]))
        await claim_by_hand("r-1")  # running: the second one waits for it
        await client.send_to(text_data=chat_request("r-2", [first, second]))
        frames = await receive_until(client, queued("r-2"), timeout=1.0)
        later = await frames_for(client, 2.5)
    assert frames[-1] == {"type": p.CHAT_QUEUED, "id": "r-2", "reason": "conversation", "position": 1}
    assert not [f for f in frames + later if f["type"] == p.CHAT_QUEUED and f["id"] == "r-1"], (
        "a turn a worker took in time is never reported queued"
    )


async def test_every_tab_of_the_conversation_hears_it(quiet_broker: Any) -> None:
    name = new_name()
    async with connected(name) as sender, connected(name) as other:
        await sender.send_to(text_data=chat_request("r-tabs", [user_message("hello")]))
        await receive_until(sender, queued("r-tabs"), timeout=5)
        frames = await receive_until(other, queued("r-tabs"), timeout=5)
    assert frames[-1]["reason"] == "workers"


async def test_a_refused_request_is_not_reported_queued(quiet_broker: Any, settings: Any) -> None:
    settings.THINK = {**settings.THINK, "MAX_QUEUED_TURNS": 1}
    first, second = user_message("one"), user_message("two")
    async with connected(new_name()) as client:
        await client.send_to(text_data=chat_request("r-1", [first]))
        await receive_until(client, queued("r-1"), timeout=5)
        await client.send_to(text_data=chat_request("r-2", [first, second]))
        frames = await frames_for(client, NOTICE_MS / 1000 * 2)
    refusal = [f for f in frames if f["type"] == p.USE_CHAT_RESPONSE and f["id"] == "r-2"]
    assert refusal and refusal[0]["error"] and "already queued" in refusal[0]["body"]
    assert not [f for f in frames if f["type"] == p.CHAT_QUEUED and f["id"] == "r-2"]


def test_the_notice_delay_is_a_positive_number(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "QUEUED_NOTICE_MS": 0}
    assert [m.id for m in check_think_settings()] == ["think_chat.E005"]


async def test_a_request_still_being_accepted_is_reported_waiting_for_the_server(
    quiet_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a burst the accept itself waits (the consumers' one database thread): the notice's clock
    runs from the request, so a slow accept is told as "server", then "workers" once it is accepted
    and still no worker has it."""
    import chat.wire.consumers

    accept = chat.wire.consumers.turn_accept
    accepted_at: list[float] = []

    def slow_accept(**kwargs: Any) -> Any:
        time.sleep(NOTICE_MS / 1000 * 3)
        try:
            return accept(**kwargs)
        finally:
            accepted_at.append(time.monotonic())

    monkeypatch.setattr(chat.wire.consumers, "turn_accept", slow_accept)
    async with connected(new_name()) as client:
        await client.send_to(text_data=chat_request("r-slow", [user_message("hello")]))
        first = await receive_until(client, queued("r-slow"), timeout=5)
        told_at = time.monotonic()
        later = await receive_until(client, queued("r-slow"), timeout=5)
    assert first[-1] == {"type": p.CHAT_QUEUED, "id": "r-slow", "reason": "server"}
    assert told_at < accepted_at[0], "told while it was being accepted"
    assert later[-1] == {"type": p.CHAT_QUEUED, "id": "r-slow", "reason": "workers"}


async def test_an_accept_waiting_on_its_conversation_holds_no_other_accept(quiet_broker: Any) -> None:
    """The web process's database calls run on a pool (chat.wire.pool), not on one thread for every
    consumer: an accept that waits (here on its conversation's row, locked elsewhere; under a burst, on
    Postgres) leaves the other conversations' accepts to go on."""
    name_a, name_b = new_name(), new_name()
    async with connected(name_a) as a, connected(name_b) as b:
        conversation_a = await database_sync_to_async(Conversation.objects.get)(name=name_a)
        with row_locked_elsewhere(Conversation, conversation_a.pk):
            await a.send_to(text_data=chat_request("r-held", [user_message("one")]))
            await asyncio.sleep(0.3)  # its accept is now waiting for the lock
            await b.send_to(text_data=chat_request("r-free", [user_message("two")]))
            await receive_until(b, waits_for_workers("r-free"), timeout=5)  # accepted, not "server"
            stored = Fiber.objects.filter(request_id__in=["r-held", "r-free"]).values_list(
                "request_id", flat=True
            )
            assert await database_sync_to_async(list)(stored) == ["r-free"], (
                "the free one only, while A waits"
            )
        await receive_until(a, waits_for_workers("r-held"), timeout=5)
    assert sorted(quiet_broker["turns"]) == sorted(
        await database_sync_to_async(list)(Fiber.objects.values_list("pk", flat=True))
    )


async def test_a_turn_a_worker_claimed_but_has_not_begun_is_reported_waiting_for_a_worker(
    quiet_broker: Any,
) -> None:
    """Under a burst a worker takes turns faster than its loop can begin them: claimed, its stream not
    open yet (no think.stream_started) when the notice is due, the turn still waits for a worker
    (bench/overload.py: 5 of 493 were never told so, and waited more than 2 s)."""
    async with connected(new_name()) as client:
        await client.send_to(text_data=chat_request("r-claimed", [user_message("hello")]))
        await claim_by_hand("r-claimed", start=False)
        frames = await receive_until(client, queued("r-claimed"), timeout=5)
    assert frames[-1] == {"type": p.CHAT_QUEUED, "id": "r-claimed", "reason": "workers"}
