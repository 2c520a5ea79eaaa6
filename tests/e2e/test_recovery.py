"""Crash recovery with real processes: workers are SIGKILLed or frozen mid-stream and turns carry on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.transcript.snapshot import FiberSnapshot, TurnKind
from recovery.models import Fiber, Incident, Segment, Stream
from tests.agents import probe_key, probe_redis
from tests.support import (
    ChatClient,
    ConversationLog,
    Proc,
    assistant_text,
    chat_request,
    follow_conversation,
    numbers,
    ticks_pass,
    user_message,
    wait_until,
    worker_children,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def own_workers(recovery_stack: Any) -> Any:
    """Each test starts the workers it kills; none outlives it to take the next test's turns."""
    yield
    recovery_stack.stop_workers()


def new_name(tag: str = "") -> str:
    return f"r{tag}-{uuid.uuid4().hex[:8]}"


async def start_turn(client: ChatClient, text: str, message_id: str | None = None) -> str:
    request_id = uuid.uuid4().hex[:10]
    await client.send(chat_request(request_id, [user_message(text, message_id)]))
    return request_id


def chunks_of(request_id: str, at_least: int) -> Any:
    return lambda log: len(log.stream(request_id).chunks) >= at_least


def stored_transcript(name: str) -> list[dict[str, Any]]:
    from chat.transcript.selectors import conversation_get, messages_list

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
        await asyncio.to_thread(recovery_stack.start_worker)
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
    incidents = [(i.status, i.attempt) async for i in Incident.objects.filter(conversation__name=name)]
    assert incidents == [("completed", 1)], "one incident, kept as the audit of a completed recovery"


async def test_a_cold_worker_recovers_a_turn_without_importing_litellm(recovery_stack: Any) -> None:
    """The only worker SIGKILLed, a new one started as a deployment starts it (an exec, not the suite's
    fork server, which has litellm imported): it continues the turn without importing litellm (the
    scripted model is an OpenAI-compatible server litellm passes requests through to: chat.turn.plain_openai),
    and imports it only when an error needs litellm's mapping."""
    cold = {"THINK_TEST_PRELOAD_LITELLM": "0"}
    worker = recovery_stack.start_worker(env=cold, forked=False)
    name = new_name("cold")
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, "count to 40 [rate 25]")
        log = await follow_conversation(client, until=chunks_of(request_id, 10), timeout=30)
        worker.kill(signal.SIGKILL)
        worker = await asyncio.to_thread(recovery_stack.start_worker, env=cold, forked=False)
        await follow_conversation(client, log, timeout=60)
        assert_clean_client_view(log, numbers(40))
        assert "litellm is not preloaded" in worker.log()
        assert "litellm imported" not in worker.log(), "the continuation needed no litellm"

        failing = await start_turn(client, "count to 5 [fail after 0 with 401]")
        failed = await follow_conversation(client, until=lambda lg: lg.stream(failing).done is not None)
    done = failed.streams[failing].done
    assert done is not None and done.get("error") and "rejected the request" in done["body"]
    assert "litellm imported" in worker.log()
    assert "AuthenticationError" in worker.log(), "litellm's own exception, mapped once it was imported"


async def test_sigkill_of_the_prefork_pool_child_recovers_the_turn(recovery_stack: Any) -> None:
    # Two children: each imports litellm as it starts (chat.tasks.preload_litellm), and a pool of eight
    # took half a minute of this machine's two cores to start, and again to replace the killed ones.
    worker = recovery_stack.start_worker(pool="prefork", concurrency=2)
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


CHAT_CALLER = """
import sys
import django

django.setup()
from chat.agents import open_agent

open_agent("assistant", sys.argv[1]).chat(["count to 60 [rate 20]"])
print("the caller finished the turn itself", flush=True)
"""


async def test_a_chat_caller_killed_mid_stream_leaves_its_turn_to_a_worker(
    recovery_stack: Any, tmp_path: Any
) -> None:
    """Think.chat() runs the turn in the calling process; SIGKILLed mid-stream, the turn is finished by a
    worker (the caller's fiber lease lapses, beat's tick hands it to recovery), with the exact text."""
    recovery_stack.start_worker()
    name = new_name("caller")
    log_path = tmp_path / "caller.log"
    async with ChatClient(recovery_stack.port, name) as client:
        await client.recv_type("cf_agent_chat_messages")  # connected: the caller's chunks reach us
        caller = Proc("chat-caller", [sys.executable, "-c", CHAT_CALLER, name], recovery_stack.env, log_path)
        caller.start()
        log = await follow_conversation(
            client,
            until=lambda log: bool(log.order) and len(log.stream(log.order[0]).chunks) >= 12,
            timeout=60,
        )
        caller.kill(signal.SIGKILL)
        await follow_conversation(client, log, timeout=90)
    assert "finished the turn itself" not in log_path.read_text(), "the caller died mid-stream"
    request_id = log.order[0]
    done = log.streams[request_id].done
    assert len(log.order) >= 2 and done is not None and done["outcome"] == "recovering", "closed by recovery"
    assert log.text == numbers(60)
    for later in log.order[1:]:
        seqs = log.streams[later].seqs
        assert seqs == list(range(len(seqs)))
    transcript = await sync_to_async(stored_transcript)(name)
    assert [m["role"] for m in transcript] == ["user", "assistant"] and assistant_text(transcript) == numbers(
        60
    )
    fiber = await Fiber.objects.aget(request_id=request_id)
    assert fiber.status == Fiber.Status.RECOVERED


def with_suppressed_kill(pid: int) -> None:
    import contextlib
    import os

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def test_repeated_kills_of_the_same_turn(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker()
    name = new_name("again")
    async with ChatClient(recovery_stack.port, name) as client:
        await start_turn(client, "count to 150 [rate 20]")
        log = ConversationLog()
        for kills in range(3):
            # Kill each incarnation of the turn once it has streamed a little.
            await follow_conversation(
                client,
                log,
                until=lambda lg, k=kills: len(lg.order) > k and len(lg.streams[lg.order[k]].chunks) >= 8,
                timeout=60,
            )
            worker.kill(signal.SIGKILL)
            worker = await asyncio.to_thread(recovery_stack.start_worker)
        await follow_conversation(client, log, timeout=90)
    assert len(log.order) == 4, "three kills, three continuations"
    assert_clean_client_view(log, numbers(150))
    transcript = await sync_to_async(stored_transcript)(name)
    assert assistant_text(transcript) == numbers(150)
    # Every continuation extended the one answer: the model sees it whole on the next turn.
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert {s.done["id"] for s in log.streams.values() if s.done} == set(log.order)


def make_interrupted_turn(
    *,
    name: str,
    agent: str,
    text: str,
    chunks: list[dict[str, Any]] | None = None,
    age_s: float = 0,
) -> tuple[str, str]:
    """A turn whose worker died after claiming it: a running fiber with an expired lease (and, with chunks,
    an open stream holding them). Returns (request id, user message id)."""
    from datetime import timedelta

    from django.utils import timezone

    from chat.models import Conversation, Message
    from chat.transcript.turns import turn_snapshot

    conversation, _ = Conversation.objects.get_or_create(agent=agent, name=name)
    user_id = f"u-{uuid.uuid4().hex[:8]}"
    Message.objects.create(
        conversation=conversation,
        message_id=user_id,
        role="user",
        parts=[{"type": "text", "text": text}],
        position=0,
    )
    request_id = f"req-{uuid.uuid4().hex[:8]}"
    snapshot = turn_snapshot(conversation=conversation, request_id=request_id, continuation=False)
    fiber = Fiber.objects.create(
        conversation=conversation,
        request_id=request_id,
        status=Fiber.Status.RUNNING,
        snapshot=snapshot.envelope(),
        fencing=1,
        lease_owner="dead-worker",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    if age_s:
        Fiber.objects.filter(pk=fiber.pk).update(created_at=timezone.now() - timedelta(seconds=age_s))
    if chunks is not None:
        stream = Stream.objects.create(
            conversation=conversation, fiber=fiber, request_id=request_id, message_id=f"a-{request_id}"
        )
        if chunks:
            Segment.objects.create(
                stream=stream,
                seq_start=0,
                seq_end=len(chunks) - 1,
                fencing=1,
                body="\n".join(json.dumps(c, separators=(",", ":")) for c in chunks),
            )
    return request_id, user_id


async def wait_fiber(request_id: str, status: str, timeout: float = 30) -> Fiber:
    for _ in range(int(timeout * 10)):
        fiber = await Fiber.objects.filter(request_id=request_id).afirst()
        if fiber is not None and fiber.status == status:
            return fiber
        await asyncio.sleep(0.1)
    raise AssertionError(f"fiber {request_id} never reached {status}")


async def transcript_when(name: str, predicate: Any, timeout: float = 40) -> list[dict[str, Any]]:
    for _ in range(int(timeout * 10)):
        transcript = await sync_to_async(stored_transcript)(name)
        if predicate(transcript):
            return transcript
        await asyncio.sleep(0.1)
    raise AssertionError(f"transcript of {name} never matched: {transcript}")


def recovery_contexts(name: str) -> list[dict[str, Any]]:
    return [json.loads(v) for v in probe_redis().lrange(probe_key("recovery", name), 0, -1)]


async def test_pre_stream_interruption_is_retried_without_duplicating_the_user_message(
    recovery_stack: Any,
) -> None:
    recovery_stack.start_worker()
    name = new_name("pre")
    request_id, user_id = await sync_to_async(make_interrupted_turn)(
        name=name, agent="recovery-probe", text="count to 8"
    )
    transcript = await transcript_when(name, lambda t: len(t) == 2 and assistant_text(t) == numbers(8))
    assert [m["id"] for m in transcript][0] == user_id
    assert [m["role"] for m in transcript] == ["user", "assistant"], "the user message is not added again"
    (seen,) = recovery_contexts(name)
    assert seen["kind"] == "retry" and seen["stream_id"] == "" and seen["attempt"] == 1
    assert seen["incident_id"] == f"{request_id}:{user_id}"
    retry = await Fiber.objects.filter(conversation__name=name, kind=TurnKind.RETRY).afirst()
    assert retry is not None and retry.status == Fiber.Status.COMPLETED
    assert FiberSnapshot.from_json(retry.snapshot).turn.recovery_root_request_id == request_id


async def test_an_opened_but_empty_stream_is_retried_not_dropped(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker()
    name = new_name("empty")
    async with ChatClient(recovery_stack.port, name, agent="recovery-probe") as client:
        request_id = await start_turn(client, "count to 12 [stall after 0 once]")
        log = await follow_conversation(
            client, until=chunks_of(request_id, 2), timeout=30
        )  # start, start-step
        await asyncio.sleep(0.5)
        worker.kill(signal.SIGKILL)
        await asyncio.to_thread(recovery_stack.start_worker)
        await follow_conversation(client, log, timeout=60)
    assert_clean_client_view(log, numbers(12))
    (seen,) = recovery_contexts(name)
    assert seen["kind"] == "retry" and seen["stream_id"] != "" and seen["partial_text"] == ""
    transcript = await sync_to_async(stored_transcript)(name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]


async def test_continue_false_keeps_the_partial_and_ends_with_an_error(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker()
    name = new_name("nocontinue")
    async with ChatClient(recovery_stack.port, name, agent="recovery-probe") as client:
        request_id = await start_turn(client, "count to 200 [rate 25]")
        log = await follow_conversation(client, until=chunks_of(request_id, 10), timeout=30)
        worker.kill(signal.SIGKILL)
        await asyncio.to_thread(recovery_stack.start_worker)
        await follow_conversation(client, log, timeout=60)
    stream = log.streams[request_id]
    assert log.order == [request_id], "nothing runs after a declined recovery"
    assert stream.done is not None and stream.done.get("error")
    assert "declined" in stream.done["body"]
    transcript = await sync_to_async(stored_transcript)(name)
    assert assistant_text(transcript) == stream.text and numbers(200).startswith(stream.text)
    incident = await Incident.objects.aget(conversation__name=name)
    assert incident.status == "skipped" and incident.reason == "continue_disabled"
    async with ChatClient(recovery_stack.port, name, agent="recovery-probe") as later:
        await later.send({"type": "cf_agent_stream_resume_request", "probeId": "late"})
        resuming = await later.recv_type("cf_agent_stream_resuming")
        assert resuming["id"] == request_id
        await later.send({"type": "cf_agent_stream_resume_ack", "id": request_id})
        replay = await later.follow(request_id, timeout=10)
    assert replay.errors and "declined" in replay.errors[-1], "a late client learns of the terminal outcome"


TOOL_PARTIAL = [
    {"type": "start", "messageId": "ignored"},
    {"type": "start-step"},
    {"type": "tool-input-start", "toolCallId": "call-1", "toolName": "charge_card"},
    {
        "type": "tool-input-available",
        "toolCallId": "call-1",
        "toolName": "charge_card",
        "input": {"cents": 500},
    },
    {"type": "tool-output-available", "toolCallId": "call-1", "output": {"charged": True}},
    {"type": "finish-step"},
    {"type": "start-step"},
    {"type": "text-start", "id": "t1"},
    {"type": "text-delta", "id": "t1", "delta": "Your card was"},
]


async def test_persist_false_still_keeps_settled_tool_results(recovery_stack: Any) -> None:
    recovery_stack.start_worker()
    name = new_name("nopersist-nocontinue")
    await sync_to_async(make_interrupted_turn)(
        name=name, agent="recovery-probe", text="pay", chunks=TOOL_PARTIAL
    )
    transcript = await transcript_when(name, lambda t: len(t) == 2)
    tool = [p for p in transcript[1]["parts"] if p["type"] == "tool-charge_card"]
    assert tool == [
        {
            "type": "tool-charge_card",
            "toolCallId": "call-1",
            "state": "output-available",
            "input": {"cents": 500},
            "output": {"charged": True},
        }
    ]


async def test_persist_false_drops_a_text_only_partial(recovery_stack: Any) -> None:
    recovery_stack.start_worker()
    name = new_name("nopersist-nocontinue")
    chunks = [
        {"type": "start"},
        {"type": "start-step"},
        {"type": "text-start", "id": "t"},
        {"type": "text-delta", "id": "t", "delta": "1 2 3"},
    ]
    request_id, _ = await sync_to_async(make_interrupted_turn)(
        name=name, agent="recovery-probe", text="count to 9", chunks=chunks
    )
    await wait_fiber(request_id, Fiber.Status.RECOVERED)
    transcript = await sync_to_async(stored_transcript)(name)
    assert [m["role"] for m in transcript] == ["user"]
    (seen,) = recovery_contexts(name)
    assert seen["partial_text"] == "1 2 3" and seen["kind"] == "continue"


async def test_hook_sees_created_at_and_can_skip_a_stale_turn(recovery_stack: Any) -> None:
    recovery_stack.start_worker()
    name = new_name("stale")
    request_id, _ = await sync_to_async(make_interrupted_turn)(
        name=name, agent="recovery-probe", text="count to 5", age_s=7200
    )
    fiber = await wait_fiber(request_id, Fiber.Status.RECOVERED)
    (seen,) = recovery_contexts(name)
    assert seen["created_at"] == int(fiber.created_at.timestamp() * 1000)
    assert await Fiber.objects.filter(conversation__name=name).acount() == 1, "a stale turn is not re-run"
    incident = await Incident.objects.aget(conversation__name=name)
    assert incident.status == "skipped" and incident.reason == "continue_disabled"


async def test_a_model_that_always_stalls_ends_with_the_terminal_message(recovery_stack: Any) -> None:
    recovery_stack.start_worker()
    name = new_name("stall")
    terminal = "Sorry: the model kept stalling."
    async with ChatClient(recovery_stack.port, name, agent="stalling-agent") as client:
        request_id = await start_turn(client, "count to 30 [stall after 0 always]")
        log = await follow_conversation(client, timeout=90)
    errors = [e for r in log.order for e in log.streams[r].errors]
    assert errors == [terminal], "the connected client gets the terminal message once"
    await asyncio.to_thread(ticks_pass, 2)  # nothing may fire a second give-up
    exhausted = [json.loads(v) for v in probe_redis().lrange(probe_key("exhausted", request_id), 0, -1)]
    assert len(exhausted) == 1, "on_exhausted is called exactly once"
    assert exhausted[0]["reason"] == "no_progress_timeout"
    incident = await Incident.objects.aget(conversation__name=name)
    assert incident.status == "exhausted" and incident.reason == "no_progress_timeout"
    transcript = await sync_to_async(stored_transcript_of)("stalling-agent", name)
    assert [m["role"] for m in transcript] == ["user"], (
        "the terminal message is never written into the transcript"
    )
    async with ChatClient(recovery_stack.port, name, agent="stalling-agent") as later:
        await later.send({"type": "cf_agent_stream_resume_request", "probeId": "after"})
        resuming = await later.recv_type("cf_agent_stream_resuming")
        await later.send({"type": "cf_agent_stream_resume_ack", "id": resuming["id"]})
        replay = await later.follow(resuming["id"], timeout=10)
    assert replay.errors == [terminal], (
        "a client that connects afterwards gets it through the resume handshake"
    )


def stored_transcript_of(agent: str, name: str) -> list[dict[str, Any]]:
    from chat.transcript.selectors import conversation_get, messages_list

    conversation = conversation_get(agent=agent, name=name)
    assert conversation is not None
    return messages_list(conversation_id=conversation.pk)


async def test_a_frozen_worker_cannot_write_after_its_lease_moved_on(recovery_stack: Any) -> None:
    zombie = recovery_stack.start_worker()
    name = new_name("zombie")
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, "count to 50 [rate 25]")
        log = await follow_conversation(client, until=chunks_of(request_id, 10), timeout=30)
        zombie.signal(signal.SIGSTOP)
        await asyncio.to_thread(recovery_stack.start_worker)
        await follow_conversation(client, log, timeout=60)
        segments = await Segment.objects.filter(stream__request_id=request_id).acount()
        zombie.signal(signal.SIGCONT)  # it wakes up believing it still owns the turn
        late: list[dict[str, Any]] = []
        with contextlib.suppress(TimeoutError):
            while True:
                frame = await client.recv(timeout=5)
                if frame.get("type") == "cf_agent_use_chat_response" and frame.get("id") == request_id:
                    late.append(frame)
    assert late == [], "a fenced-out worker sends no frames"
    assert await Segment.objects.filter(stream__request_id=request_id).acount() == segments, (
        "and writes no chunks"
    )
    fiber = await Fiber.objects.aget(request_id=request_id)
    assert fiber.status == Fiber.Status.RECOVERED and fiber.fencing == 2
    assert_clean_client_view(log, numbers(50))
    transcript = await sync_to_async(stored_transcript)(name)
    assert assistant_text(transcript) == numbers(50), "and cannot finish the message"
    assert "lease" in zombie.log() and "lost" in zombie.log()


async def test_worker_shutdown_hands_the_turn_to_recovery_at_once(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker()
    name = new_name("deploy")
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, "count to 80 [rate 15]")
        log = await follow_conversation(client, until=chunks_of(request_id, 10), timeout=30)
        worker.signal(signal.SIGTERM)  # a deploy: warm shutdown
        wait_until(lambda: worker.popen.poll() is not None, 15, "the old worker to exit")
        fiber = await Fiber.objects.aget(request_id=request_id)
        # Released, not left to expire: the lease ended before its TTL (or recovery already has it).
        released = fiber.lease_expires_at is not None and fiber.lease_expires_at < fiber.heartbeat_at
        assert released or fiber.status in (Fiber.Status.INTERRUPTED, Fiber.Status.RECOVERED)
        await asyncio.to_thread(recovery_stack.start_worker)
        await follow_conversation(client, log, timeout=60)
    assert "handed to recovery" in worker.log()
    assert_clean_client_view(log, numbers(80))
    transcript = await sync_to_async(stored_transcript)(name)
    assert assistant_text(transcript) == numbers(80)


@pytest.mark.parametrize(
    "habit", ["[restart all]"]
)  # every habit in-process: tests/chat/turn/test_seam_recovery.py
async def test_a_worker_killed_mid_sentence_leaves_no_seam_in_the_answer(
    recovery_stack: Any, habit: str
) -> None:
    """Issue 39: the continuation of a story cut off mid-answer comes from a model with a real model's habit
    (the sentence again, or the whole answer again glued on); the client and the store get the story once."""
    from think_scripted.server import STORY

    worker = recovery_stack.start_worker()
    name = new_name("seam")
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, f"[story] {habit} [rate 25]")
        log = await follow_conversation(client, until=chunks_of(request_id, 4), timeout=30)
        worker.kill(signal.SIGKILL)
        await asyncio.to_thread(recovery_stack.start_worker)
        await follow_conversation(client, log, timeout=60)
    assert len(log.order) >= 2, "the turn must have been continued by a new request"
    assert_clean_client_view(log, STORY)
    transcript = await sync_to_async(stored_transcript)(name)
    assert assistant_text(transcript) == STORY
