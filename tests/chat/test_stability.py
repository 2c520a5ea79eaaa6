"""has_pending_interaction / wait_until_stable and the outcome of a recovery chain."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from chat.agents import Think
from chat.handle import AgentHandle
from chat.models import Conversation, Message
from chat.transcript.interactions import interaction_apply
from chat.transcript.selectors import chain_outcome
from recovery.models import Alarm, Fiber, Incident

pytestmark = pytest.mark.django_db(transaction=True)

CLIENT_TOOLS = [{"name": "get_location"}]


def make(parts: list[dict[str, Any]], *, client_tools: list[dict[str, Any]] | None = None) -> AgentHandle:
    conversation = Conversation.objects.create(agent="assistant", name=f"s-{time.monotonic_ns()}")
    conversation.last_client_tools = client_tools
    conversation.save()
    Message.objects.create(conversation=conversation, message_id="u", role="user", parts=[], position=0)
    Message.objects.create(
        conversation=conversation, message_id="a", role="assistant", parts=parts, position=1
    )
    return AgentHandle(Think(agent="assistant", name=conversation.name, conversation_id=conversation.pk))


def tool(name: str, state: str, call: str = "c1") -> dict[str, Any]:
    return {"type": f"tool-{name}", "toolCallId": call, "state": state, "input": {}}


def test_stable_with_nothing_pending() -> None:
    agent = make([{"type": "text", "text": "hi"}])
    assert not agent.has_pending_interaction()
    assert agent.wait_until_stable(timeout=0.2)


def test_a_pending_client_tool_is_detected_including_one_only_in_the_partial() -> None:
    agent = make([{"type": "text", "text": "hi"}], client_tools=CLIENT_TOOLS)
    assert not agent.has_pending_interaction()
    partial = {"id": "p", "role": "assistant", "parts": [tool("get_location", "input-available")]}
    assert agent.has_pending_interaction([partial])


def test_a_server_tool_orphan_does_not_block() -> None:
    agent = make([tool("add", "input-available")], client_tools=CLIENT_TOOLS)
    assert not agent.has_pending_interaction()
    partial = {"id": "p", "role": "assistant", "parts": [tool("add", "input-available")]}
    assert not agent.has_pending_interaction([partial])
    assert agent.wait_until_stable(timeout=0.2)


def test_a_pending_approval_is_detected() -> None:
    agent = make([tool("delete_file", "approval-requested")])
    assert agent.has_pending_interaction()
    assert not agent.wait_until_stable(timeout=0.3)


def test_stable_once_the_result_is_applied() -> None:
    agent = make([tool("get_location", "input-available")], client_tools=CLIENT_TOOLS)
    assert not agent.wait_until_stable(timeout=0.3)
    update = {
        "kind": "result",
        "toolCallId": "c1",
        "state": "output-available",
        "output": 1,
        "autoContinue": False,
    }

    def answer() -> None:
        time.sleep(0.3)
        interaction_apply(conversation_id=agent.conversation_id, update=update)  # type: ignore[arg-type]

    thread = threading.Thread(target=answer)
    thread.start()
    started = time.monotonic()
    assert agent.wait_until_stable(timeout=5)
    thread.join()
    assert time.monotonic() - started >= 0.25, "it waited for the answer"


def test_not_stable_while_an_auto_continuation_is_armed(monkeypatch: pytest.MonkeyPatch) -> None:
    import chat.transcript.turns

    # No worker may run the continuation (a session stack could): it must stay queued.
    monkeypatch.setattr(chat.transcript.turns, "turn_enqueue", lambda **kwargs: None)
    agent = make([tool("get_location", "input-available")], client_tools=CLIENT_TOOLS)
    update = {
        "kind": "result",
        "toolCallId": "c1",
        "state": "output-available",
        "output": 1,
        "autoContinue": True,
    }
    applied = interaction_apply(conversation_id=agent.conversation_id, update=update)  # type: ignore[arg-type]
    assert applied.continuation_request_id
    assert not agent.has_pending_interaction()
    assert not agent.wait_until_stable(timeout=0.3), "the continuation is queued: not idle"
    Fiber.objects.filter(request_id=applied.continuation_request_id).update(status=Fiber.Status.COMPLETED)
    assert agent.wait_until_stable(timeout=0.5)


# -- the outcome of a recovery chain (save_messages(wait=True), submissions) ------------------------------
def chain(conversation: Conversation, root: str, *statuses: str) -> None:
    for index, status in enumerate(statuses):
        request_id = root if index == 0 else f"{root}-cont-{index}"
        snapshot = {"chat": {"requestId": request_id, "recoveryRootRequestId": root}}
        Fiber.objects.create(
            conversation=conversation, request_id=request_id, status=status, snapshot=snapshot
        )


@pytest.fixture
def conversation() -> Conversation:
    return Conversation.objects.create(agent="assistant", name="chains")


def test_a_recovered_turn_continued_to_completion_is_completed(conversation: Conversation) -> None:
    chain(conversation, "r1", "recovered", "recovered", "completed")
    assert chain_outcome(conversation_id=conversation.pk, root_request_id="r1") == "completed"


@pytest.mark.parametrize("callback", ["chat_recovery_continue", "chat_recovery_retry"])
def test_a_scheduled_continue_or_retry_keeps_the_chain_open(
    conversation: Conversation, callback: str
) -> None:
    chain(conversation, "r1", "recovered")
    Alarm.objects.create(
        conversation=conversation,
        callback=callback,
        payload={"originalRequestId": "r1"},
        due_at="2030-01-01T00:00Z",
    )
    assert chain_outcome(conversation_id=conversation.pk, root_request_id="r1") is None


def test_a_running_or_interrupted_fiber_keeps_the_chain_open(conversation: Conversation) -> None:
    chain(conversation, "r1", "recovered", "interrupted")
    assert chain_outcome(conversation_id=conversation.pk, root_request_id="r1") is None


def test_an_abandoned_chain_is_an_error(conversation: Conversation) -> None:
    chain(conversation, "r1", "recovered")
    Incident.objects.create(
        conversation=conversation,
        incident_id="r1:u",
        request_id="r1",
        recovery_root_request_id="r1",
        recovery_kind="continue",
        max_attempts=3,
        status="exhausted",
        first_seen_at=0,
        last_attempt_at=0,
    )
    assert chain_outcome(conversation_id=conversation.pk, root_request_id="r1") == "error"


@pytest.mark.parametrize(("status", "outcome"), [("failed", "error"), ("cancelled", "aborted")])
def test_failed_and_cancelled_turns(conversation: Conversation, status: str, outcome: str) -> None:
    chain(conversation, "r1", status)
    assert chain_outcome(conversation_id=conversation.pk, root_request_id="r1") == outcome
