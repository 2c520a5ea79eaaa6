"""Crash recovery with real processes: workers are SIGKILLed or frozen mid-stream and turns carry on."""

from __future__ import annotations

import signal
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from recovery.models import Fiber, Incident
from tests.support import (
    ChatClient,
    ConversationLog,
    chat_request,
    follow_conversation,
    user_message,
    worker_children,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def own_workers(recovery_stack: Any) -> Any:
    """Each test starts the workers it kills; none outlives it to take the next test's turns."""
    yield
    recovery_stack.stop_workers()


def numbers(n: int, start: int = 1) -> str:
    return " ".join(str(i) for i in range(start, n + 1))


def new_name(tag: str = "") -> str:
    return f"r{tag}-{uuid.uuid4().hex[:8]}"


async def start_turn(client: ChatClient, text: str, message_id: str | None = None) -> str:
    request_id = uuid.uuid4().hex[:10]
    await client.send(chat_request(request_id, [user_message(text, message_id)]))
    return request_id


def chunks_of(request_id: str, at_least: int) -> Any:
    return lambda log: len(log.stream(request_id).chunks) >= at_least


def assistant_text(messages: list[dict[str, Any]]) -> str:
    return "".join(
        p.get("text", "")
        for m in messages
        if m["role"] == "assistant"
        for p in m["parts"]
        if p["type"] == "text"
    )


def stored_transcript(name: str) -> list[dict[str, Any]]:
    from chat.selectors import conversation_get, messages_list

    conversation = conversation_get(agent="assistant", name=name) or conversation_get(
        agent="recovery-probe", name=name
    )
    assert conversation is not None
    return messages_list(conversation_id=conversation.pk)


def assert_clean_client_view(log: ConversationLog, expected: str) -> None:
    """What the client holds: every stream's seqs contiguous from 0, and the text exactly as expected."""
    for request_id in log.order:
        seqs = log.streams[request_id].seqs
        assert seqs == list(range(len(seqs))), f"stream {request_id} has a gap or duplicate: {seqs}"
    assert log.text == expected


async def test_sigkill_of_the_whole_worker_mid_stream_recovers_the_turn(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker()
    name = new_name("kill")
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, "count to 60 [rate 25]")
        log = await follow_conversation(client, until=chunks_of(request_id, 15), timeout=30)
        worker.kill(signal.SIGKILL)
        recovery_stack.start_worker()
        await follow_conversation(client, log, timeout=60)
    assert len(log.order) >= 2, "the turn must have been continued by a new request"
    assert (
        log.streams[request_id].done is not None and log.streams[request_id].done["outcome"] == "recovering"
    )
    assert_clean_client_view(log, numbers(60))
    assert True in log.recovering and log.recovering[-1] is False
    transcript = await sync_to_async(stored_transcript)(name)
    assert [m["role"] for m in transcript][0] == "user"
    assert [m["role"] for m in transcript].count("user") == 1
    assert assistant_text(transcript) == numbers(60)
    assert await Incident.objects.filter(conversation__name=name).acount() == 0, (
        "a completed incident is deleted"
    )


async def test_sigkill_of_the_prefork_pool_child_recovers_the_turn(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker(pool="prefork")
    name = new_name("child")
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, "count to 50 [rate 25]")
        log = await follow_conversation(client, until=chunks_of(request_id, 12), timeout=30)
        children = worker_children(worker)
        assert children, "a prefork worker has pool children"
        fiber = await Fiber.objects.aget(request_id=request_id)
        for pid in children:  # the child running the turn is one of them; killing all is the harsher case
            with_suppressed_kill(pid)
        await follow_conversation(client, log, timeout=60)
    assert_clean_client_view(log, numbers(50))
    await fiber.arefresh_from_db()
    assert fiber.status == Fiber.Status.RECOVERED
    transcript = await sync_to_async(stored_transcript)(name)
    assert assistant_text(transcript) == numbers(50)
    worker.stop()


def with_suppressed_kill(pid: int) -> None:
    import contextlib
    import os

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def test_repeated_kills_of_the_same_turn(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker()
    name = new_name("again")
    async with ChatClient(recovery_stack.port, name) as client:
        await start_turn(client, "count to 90 [rate 25]")
        log = ConversationLog()
        for _ in range(3):
            seen = sum(len(s.chunks) for s in log.streams.values())
            await follow_conversation(
                client,
                log,
                until=lambda lg, n=seen: sum(len(s.chunks) for s in lg.streams.values()) >= n + 15,
                timeout=60,
            )
            worker.kill(signal.SIGKILL)
            worker = recovery_stack.start_worker()
        await follow_conversation(client, log, timeout=90)
    assert len(log.order) >= 4
    assert_clean_client_view(log, numbers(90))
    transcript = await sync_to_async(stored_transcript)(name)
    assert assistant_text(transcript) == numbers(90)
    worker.stop()
