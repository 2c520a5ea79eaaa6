"""Stop is immediate and final: a cancel reaches the worker at once, and from the moment it commits
nothing more of the turn is stored or sent (the store then equals what clients were shown)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.models import Conversation
from recovery.lease.fibers import fiber_request_cancel
from recovery.models import Fiber, Segment
from tests.support import (
    ChatClient,
    StreamLog,
    chat_request,
    numbers,
    user_message,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# A lease renewed only every 30 s: what a turn hears of a cancel before then, it heard from the signal.
SLOW_HEARTBEAT = {"THINK_TEST_HEARTBEAT_INTERVAL_S": "30", "THINK_TEST_LEASE_TTL_S": "60"}


@pytest.fixture
def own_workers(recovery_stack: Any) -> Any:
    yield recovery_stack
    recovery_stack.stop_workers()


def stored_seq(request_id: str) -> int:
    """The seq of the last chunk stored for a request (-1 for none)."""
    last = Segment.objects.filter(stream__request_id=request_id).order_by("-seq_end").first()
    return last.seq_end if last is not None else -1


def stored_answer(name: str) -> str:
    from chat.transcript.selectors import messages_list

    conversation = Conversation.objects.get(agent="assistant", name=name)
    return "".join(
        p.get("text", "")
        for m in messages_list(conversation_id=conversation.pk)
        if m["role"] == "assistant"
        for p in m["parts"]
        if p["type"] == "text"
    )


async def test_a_cancel_stops_a_silent_turn_long_before_its_heartbeat(
    own_workers: Any, scripted_model: Any
) -> None:
    """The model has gone quiet (nothing to flush, so no write would notice the flag): only the signal
    can stop the turn before its heartbeat, 30 s away; the model call is closed as well."""
    own_workers.start_worker(env=SLOW_HEARTBEAT)
    name = f"stop-{uuid.uuid4().hex[:8]}"
    async with ChatClient(own_workers.port, name) as client:
        await client.send(chat_request("r-1", [user_message("count to 50 [stall after 3]")]))
        log = StreamLog()
        while log.text != numbers(3):  # then the model goes quiet
            await client.follow("r-1", log, stop_after=len(log.chunks) + 1, timeout=30)
        await asyncio.sleep(0.3)  # stalled: the turn has nothing more to write
        assert await sync_to_async(stored_seq)("r-1") == log.seqs[-1]
        await client.send({"type": "cf_agent_chat_request_cancel", "id": "r-1"})
        await client.follow("r-1", log, timeout=10)
    assert log.done is not None and log.done["outcome"] == "aborted" and not log.done.get("error")
    fiber = await Fiber.objects.aget(request_id="r-1")
    assert fiber.status == Fiber.Status.CANCELLED
    await asyncio.to_thread(wait_until, lambda: scripted_model.in_flight == 0, 5, "the model call to close")
    assert await sync_to_async(stored_answer)(name) == log.text == numbers(3)


async def test_nothing_is_stored_or_sent_after_a_cancel_commits(own_workers: Any) -> None:
    """Without the signal (THINK['CANCEL_SIGNALS'] off, as behind a pooler) the turn runs on until its
    next write; that write, and every one after it, is refused by the fenced statement itself."""
    own_workers.start_worker(env={"THINK_CANCEL_SIGNALS": "0", **SLOW_HEARTBEAT})
    name = f"stop-{uuid.uuid4().hex[:8]}"
    async with ChatClient(own_workers.port, name) as client:
        await client.send(chat_request("r-2", [user_message("count to 300 [rate 100]")]))
        log = await client.follow("r-2", stop_after=20, timeout=30)
        conversation = await Conversation.objects.aget(agent="assistant", name=name)
        await sync_to_async(fiber_request_cancel)(conversation_id=conversation.pk, request_id="r-2")
        at_cancel = await sync_to_async(stored_seq)("r-2")  # final: later writes wait for, then see, it
        await client.follow("r-2", log, timeout=15)
    assert log.done is not None and log.done["outcome"] == "aborted"
    assert await sync_to_async(stored_seq)("r-2") == at_cancel
    assert max(s for s in log.seqs if s is not None) <= at_cancel, "no frame beyond the store"
    assert log.done["seq"] == at_cancel + 1, "the end frame follows the last stored chunk"
    stored = await sync_to_async(stored_answer)(name)
    assert numbers(300).startswith(stored) and stored.startswith(log.text)
    assert len(stored.split()) < 300


async def test_the_stopped_answer_is_the_stored_chunks(stack: Any) -> None:
    """What a stopped turn stores is exactly what its stream sent, and the transcript follows the end."""
    name = f"stop-{uuid.uuid4().hex[:8]}"
    async with ChatClient(stack.port, name) as client:
        await client.send(chat_request("r-3", [user_message("count to 300 [rate 50]")]))
        log = await client.follow("r-3", stop_after=15, timeout=30)
        await client.send({"type": "cf_agent_chat_request_cancel", "id": "r-3"})
        await client.follow("r-3", log, timeout=15)
        snapshot = await client.recv_type("cf_agent_chat_messages", timeout=5)
    assert log.done is not None and log.done["outcome"] == "aborted"
    assert log.seqs == list(range(len(log.seqs))) and log.done["seq"] == len(log.seqs)
    stored = await sync_to_async(stored_answer)(name)
    assert stored == log.text, "the store holds what was sent, and nothing else"
    [answer] = [m for m in snapshot["messages"] if m["role"] == "assistant"]
    assert "".join(p.get("text", "") for p in answer["parts"] if p["type"] == "text") == stored
