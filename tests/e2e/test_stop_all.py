"""Stop everything (cf_agent_chat_stop) on the real stack: every tab hears it at once, nothing of the old
work resumes, not even after its worker was SIGKILLed, and the next message runs as new work."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from chat.models import Conversation
from chat.transcript.stop import STOPPED_TOOL_ERROR
from recovery.conf import setting as recovery_setting
from recovery.models import Fiber, Incident, Stream
from tests.support import (
    ChatClient,
    ConversationLog,
    assistant_text,
    chat_request,
    follow_conversation,
    numbers,
    ticks_pass,
    user_message,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

STOP = {"type": "cf_agent_chat_stop"}


def stored(agent: str, name: str) -> list[dict[str, Any]]:
    from chat.transcript.selectors import messages_list

    conversation = Conversation.objects.get(agent=agent, name=name)
    return messages_list(conversation_id=conversation.pk)


async def until_stopped(
    client: ChatClient, log: ConversationLog | None = None
) -> tuple[ConversationLog, dict[str, Any]]:
    """Follow the conversation until the stopped frame (acknowledging a resume, as the published client
    does); the turns seen meanwhile and that frame."""
    log = log or ConversationLog()
    while True:
        frame = await client.recv(15)
        if frame["type"] == "cf_agent_chat_stopped":
            return log, frame
        if frame["type"] == "cf_agent_stream_resuming":
            await client.send({"type": "cf_agent_stream_resume_ack", "id": frame["id"]})
        if frame["type"] == "cf_agent_use_chat_response":
            log.stream(frame["id"]).record(frame)


async def test_a_stop_from_one_tab_ends_the_stream_in_every_tab_and_the_next_message_runs(stack: Any) -> None:
    name = f"stopall-{uuid.uuid4().hex[:8]}"
    async with ChatClient(stack.port, name) as sender, ChatClient(stack.port, name) as other:
        await sender.send(chat_request("r-long", [user_message("count to 400 [rate 40]")]))
        seen = await sender.follow("r-long", stop_after=8, timeout=30)
        await other.send(STOP)
        sender_log, sender_stopped = await until_stopped(
            sender, ConversationLog(order=["r-long"], streams={"r-long": seen})
        )
        other_log, other_stopped = await until_stopped(other)

        for log, frame in ((sender_log, sender_stopped), (other_log, other_stopped)):
            assert frame["requestIds"] == ["r-long"]
            done = log.streams["r-long"].done
            assert done is not None and done["outcome"] == "aborted" and not done.get("error")
        text = sender_log.streams["r-long"].text
        seqs = sender_log.streams["r-long"].seqs
        assert seqs == list(range(len(seqs))), "every chunk once, in order, then the end"
        messages = await sync_to_async(stored)("assistant", name)
        assert assistant_text(messages) == text, "the stored answer is what the tabs were shown"
        fiber = await Fiber.objects.aget(request_id="r-long", conversation__name=name)
        assert fiber.status == Fiber.Status.CANCELLED

        await sender.send(chat_request("r-next", [user_message("count to 3")]))
        after = await sender.follow("r-next", timeout=30)
    assert after.done is not None and after.done["outcome"] == "completed" and after.text == "1 2 3"


async def test_a_stop_settles_the_pending_approval_then_cancels_the_queued_turn(stack: Any) -> None:
    """A tool waits for a human: stop settles it. Then a turn runs with another queued behind it: stop
    ends the one and cancels the other before it streamed a chunk. (A new message would settle the
    approval itself, as an interrupted call, so the two cases come one after the other.)"""
    t = f"tag-{uuid.uuid4().hex[:8]}"
    name = f"stopall-{t}"
    async with ChatClient(stack.port, name, "tool-agent") as client:
        await client.send(
            chat_request("r-ask", [user_message(f"[tool delete_file {json.dumps({'tag': t})}]")])
        )
        asked = await client.follow("r-ask", timeout=30)
        [approval] = [c for _, c in asked.chunks if c["type"] == "tool-approval-request"]
        await client.send(STOP)
        _, settled = await until_stopped(client)
        assert settled["toolCalls"] == [approval["toolCallId"]] and settled["requestIds"] == []
        messages = await sync_to_async(stored)("tool-agent", name)
        [part] = [p for m in messages for p in m["parts"] if p.get("toolCallId") == approval["toolCallId"]]
        assert (part["state"], part["errorText"]) == ("output-error", STOPPED_TOOL_ERROR)

        await client.send(chat_request("r-slow", [user_message("count to 400 [rate 40]")]))
        await client.follow("r-slow", stop_after=3, timeout=30)
        await client.send(chat_request("r-queued", [user_message("count to 5")]))
        await client.recv_type("cf_agent_chat_queued")
        await client.send(STOP)
        log, stopped = await until_stopped(client)

    assert set(stopped["requestIds"]) == {"r-slow", "r-queued"} and stopped["toolCalls"] == []
    queued = log.streams["r-queued"]
    assert queued.done is not None and queued.done["outcome"] == "aborted" and not queued.chunks
    statuses = {f.request_id: f.status async for f in Fiber.objects.filter(conversation__name=name)}
    assert statuses == {"r-ask": "completed", "r-slow": "cancelled", "r-queued": "cancelled"}


async def test_a_stop_after_the_worker_was_killed_leaves_nothing_for_recovery(recovery_stack: Any) -> None:
    """The worker dies mid-stream and the stop comes before any recovery: a new worker (and the beat
    tick, whose takeover would find the lapsed lease) resumes nothing; the partial is the answer."""
    worker = recovery_stack.start_worker()
    name = f"stopall-kill-{uuid.uuid4().hex[:8]}"
    try:
        async with ChatClient(recovery_stack.port, name) as client:
            await client.send(chat_request("r-dead", [user_message("count to 400 [rate 40]")]))
            seen = await client.follow("r-dead", stop_after=8, timeout=30)
            worker.kill(signal.SIGKILL)
            await client.send(STOP)
            log, stopped = await until_stopped(
                client, ConversationLog(order=["r-dead"], streams={"r-dead": seen})
            )
            assert stopped["requestIds"] == ["r-dead"]
            done = log.streams["r-dead"].done
            assert done is not None and done["outcome"] == "aborted"

            await asyncio.to_thread(recovery_stack.start_worker)
            # Any recovery would start at a tick after the dead worker's lease lapsed: wait for two.
            dead = await Fiber.objects.aget(request_id="r-dead", conversation__name=name)
            assert dead.heartbeat_at is not None
            lapse = dead.heartbeat_at + timedelta(seconds=recovery_setting("LEASE_TTL_S"))
            await asyncio.sleep(max(0.0, (lapse - timezone.now()).total_seconds()))
            await asyncio.to_thread(ticks_pass, 2)
            fibers = [(f.request_id, f.status) async for f in Fiber.objects.filter(conversation__name=name)]
            assert fibers == [("r-dead", "cancelled")], "nothing was taken over or continued"
            assert not await Incident.objects.filter(conversation__name=name).aexists()
            stream = await Stream.objects.aget(request_id="r-dead", conversation__name=name)
            assert stream.status == Stream.Status.COMPLETED
            messages = await sync_to_async(stored)("assistant", name)
            assert assistant_text(messages) == log.streams["r-dead"].text

            await client.send(chat_request("r-new", [user_message("count to 4")]))
            after = await follow_conversation(client, timeout=30)
        assert after.streams["r-new"].text == numbers(4)
    finally:
        recovery_stack.stop_workers()
