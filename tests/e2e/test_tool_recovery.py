"""Tools under crashes: a real worker is SIGKILLed around tool calls and the turn carries on correctly."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.models import Conversation
from recovery.models import Incident
from tests.agents import tool_runs
from tests.support import (
    ChatClient,
    ConversationLog,
    assistant_text,
    chat_request,
    continuation_completed,
    follow_conversation,
    numbers,
    user_message,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

AGENT = "tool-agent"
CLIENT_TOOLS = [{"name": "get_location", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(autouse=True)
def own_workers(recovery_stack: Any) -> Any:
    yield
    recovery_stack.stop_workers()


def tag() -> str:
    return f"tag-{uuid.uuid4().hex[:8]}"


def transcript(name: str) -> list[dict[str, Any]]:
    from chat.transcript.selectors import conversation_get, messages_list

    conversation = conversation_get(agent=AGENT, name=name)
    assert conversation is not None
    return messages_list(conversation_id=conversation.pk)


def chunk_seen(kind: str) -> Any:
    def seen(log: ConversationLog) -> bool:
        return any(c.get("type") == kind for s in log.streams.values() for _, c in s.chunks)

    return seen


def parked(name: str) -> bool:
    return Incident.objects.filter(
        conversation__name=name, status="skipped", reason="awaiting_client_interaction"
    ).exists()


async def test_a_kill_after_a_tool_result_settled_does_not_run_the_tool_again(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker()
    t = tag()
    name = f"tr-{t}"
    prompt = f"[tool add {json.dumps({'tag': t, 'a': 1, 'b': 2})}] count to 120 [rate 30]"
    async with ChatClient(recovery_stack.port, name, AGENT) as client:
        await client.send(chat_request("turn-1", [user_message(prompt)]))

        def answering(log: ConversationLog) -> bool:
            return "returned: 3 1 2 3 4 5" in log.text

        log = await follow_conversation(client, until=answering, timeout=30)
        worker.kill(signal.SIGKILL)
        await asyncio.to_thread(recovery_stack.start_worker)
        await follow_conversation(client, log, timeout=60)
    expected = f"Tool add returned: 3 {numbers(120)}"
    assert log.text == expected
    messages = await sync_to_async(transcript)(name)
    assert assistant_text(messages) == expected
    tools = [p for m in messages for p in m["parts"] if p["type"] == "tool-add"]
    assert [(p["state"], p["output"]) for p in tools] == [("output-available", 3)]
    assert await sync_to_async(tool_runs)(t) == 1, "a settled tool result is never executed again"


async def test_a_kill_while_a_client_tool_is_pending_parks_then_resumes_with_the_result(
    recovery_stack: Any,
) -> None:
    worker = recovery_stack.start_worker()
    name = f"hold-{tag()}"
    async with ChatClient(recovery_stack.port, name, AGENT) as client:
        await client.send(
            chat_request("turn-1", [user_message("[tool get_location {}]")], clientTools=CLIENT_TOOLS)
        )
        log = await follow_conversation(client, until=chunk_seen("tool-input-available"), timeout=30)
        call = next(c for _, c in log.streams["turn-1"].chunks if c["type"] == "tool-input-available")
        worker.kill(signal.SIGKILL)  # the turn is held after its tool step: the call is stored, no finish
        await asyncio.to_thread(recovery_stack.start_worker)
        await asyncio.to_thread(wait_until, lambda: parked(name), 30, "recovery to park on the human")
        incident = await Incident.objects.aget(conversation__name=name)
        assert incident.attempt == 1, "a pending human costs no budget"
        messages = await sync_to_async(transcript)(name)
        [part] = [p for p in messages[-1]["parts"] if p["type"] == "tool-get_location"]
        assert part["state"] == "input-available", "the partial with the pending call was kept"

        await client.send(
            {
                "type": "cf_agent_tool_result",
                "toolCallId": call["toolCallId"],
                "toolName": "get_location",
                "output": {"city": "Oslo"},
            }
        )
        await follow_conversation(client, log, until=continuation_completed, timeout=30)
    messages = await sync_to_async(transcript)(name)
    assert [m["role"] for m in messages] == ["user", "assistant"], "the continuation extended the partial"
    assert assistant_text(messages) == 'Tool get_location returned: {"city": "Oslo"}'


async def approval_asked(client: ChatClient, t: str) -> tuple[ConversationLog, dict[str, Any]]:
    """Send a call of `delete_file` (it needs approval) and read on until the approval is asked."""
    await client.send(chat_request("turn-1", [user_message(f"[tool delete_file {json.dumps({'tag': t})}]")]))
    log = await follow_conversation(client, until=chunk_seen("tool-approval-request"), timeout=30)
    request = next(c for _, c in log.streams["turn-1"].chunks if c["type"] == "tool-approval-request")
    return log, request


async def test_a_kill_during_an_approval_runs_the_approved_tool_once(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker()
    t = tag()
    name = f"hold-{t}"
    async with ChatClient(recovery_stack.port, name, AGENT) as client:
        log, request = await approval_asked(client, t)
        worker.kill(signal.SIGKILL)
        # Answered before recovery even noticed: the answer waits for the interrupted turn's message.
        await client.send(
            {"type": "cf_agent_tool_approval", "toolCallId": request["toolCallId"], "approved": True}
        )

        def buffered() -> bool:
            return bool(Conversation.objects.get(agent=AGENT, name=name).tool_updates)

        await asyncio.to_thread(wait_until, buffered, 10, "the approval to wait for its turn's message")
        await asyncio.to_thread(recovery_stack.start_worker)
        await follow_conversation(client, log, until=continuation_completed, timeout=60)
    messages = await sync_to_async(transcript)(name)
    assert assistant_text(messages) == f"Tool delete_file returned: deleted {t}"
    [part] = [p for m in messages for p in m["parts"] if p["type"] == "tool-delete_file"]
    assert part["state"] == "output-available" and part["approval"]["approved"] is True
    assert await sync_to_async(tool_runs)(t) == 1
    conversation = await Conversation.objects.aget(agent=AGENT, name=name)
    assert conversation.tool_updates == [] and conversation.continue_armed == ""


async def test_a_turn_parked_on_an_approval_across_a_worker_kill_resumes_when_code_approves(
    recovery_stack: Any,
) -> None:
    """Issue 36: the worker dies while the turn waits for an approval; recovery parks on the human; the
    approval comes from code (AgentHandle.aapprove) with no socket open, and the tool runs once."""
    from chat.agents import aopen_agent
    from chat.handle import aturn_wait

    worker = recovery_stack.start_worker()
    t = tag()
    name = f"hold-{t}"
    async with ChatClient(recovery_stack.port, name, AGENT) as client:
        _, request = await approval_asked(client, t)
    worker.kill(signal.SIGKILL)  # held after its tool step: the request is stored, no finish
    await asyncio.to_thread(recovery_stack.start_worker)
    await asyncio.to_thread(wait_until, lambda: parked(name), 30, "recovery to park on the human")

    handle = await aopen_agent(AGENT, name)
    waiting = await sync_to_async(handle.waiting_approvals)()
    assert [(c["toolCallId"], c["tool"], c["input"]) for c in waiting] == [
        (request["toolCallId"], "delete_file", {"tag": t})
    ]
    decision = await handle.aapprove(request["toolCallId"])
    assert decision.status == "applied" and decision.continuation_request_id
    result = await aturn_wait(
        conversation_id=handle.conversation_id, request_id=decision.continuation_request_id, timeout=60
    )
    assert result.status == "completed"
    messages = await sync_to_async(transcript)(name)
    assert [m["role"] for m in messages] == ["user", "assistant"], "the continuation extended the partial"
    assert assistant_text(messages) == f"Tool delete_file returned: deleted {t}"
    assert await sync_to_async(tool_runs)(t) == 1
