"""Tool results and approvals applied to stored messages: updates, buffering, batches, continuations."""

from __future__ import annotations

from typing import Any

import pytest

from chat.models import Conversation, Message
from chat.transcript.finish import interactions_settle
from chat.transcript.interactions import DENIED_TEXT, approval_update, interaction_apply, result_update
from chat.transcript.snapshot import FiberSnapshot, TurnKind
from recovery.models import Fiber
from tests.chat.transcript.test_answer_buffer import stream_calls


def part(state: str, call: str = "c1", **extra: Any) -> dict[str, Any]:
    return {"type": "tool-x", "toolCallId": call, "state": state, "input": {}, **extra}


# -- the pure updates -----------------------------------------------------------------------------------
def test_a_result_answers_a_waiting_call() -> None:
    updated = result_update(part("input-available"), {"state": "output-available", "output": {"a": 1}})
    assert updated is not None
    assert (updated["state"], updated["output"], updated["preliminary"]) == (
        "output-available",
        {"a": 1},
        False,
    )


def test_an_error_result_gets_the_default_text() -> None:
    updated = result_update(part("input-available"), {"state": "output-error", "errorText": None})
    assert updated is not None and updated["errorText"] == DENIED_TEXT


@pytest.mark.parametrize(
    "state",
    ["output-available", "output-error", "output-denied", "input-streaming", "approval-requested"],
)
def test_a_result_for_a_call_that_is_not_waiting_is_a_no_op(state: str) -> None:
    assert result_update(part(state), {"state": "output-available", "output": 1}) is None


def test_an_approval_keeps_the_approval_id_and_records_the_decision() -> None:
    requested = part("approval-requested", approval={"id": "ap-1"})
    approved = approval_update(requested, {"approved": True})
    denied = approval_update(requested, {"approved": False})
    assert approved is not None and denied is not None
    assert approved["state"] == "approval-responded" and approved["approval"] == {
        "id": "ap-1",
        "approved": True,
    }
    assert denied["state"] == "output-denied" and denied["approval"] == {"id": "ap-1", "approved": False}
    assert approval_update(part("approval-requested"), {"approved": True})["approval"]["id"] == "c1"  # type: ignore[index]
    assert approval_update(approved, {"approved": False}) is None, "a decision is final"
    # A call that never asked (a server tool's call left unanswered by a cancel, say) is not approved:
    # the worker would run it, perhaps again.
    assert approval_update(part("input-available"), {"approved": True}) is None


# -- against the database -----------------------------------------------------------------------------------
@pytest.fixture
def conversation(db: Any) -> Conversation:
    conversation = Conversation.objects.create(agent="assistant", name="interactions")
    Message.objects.create(
        conversation=conversation,
        message_id="u1",
        role="user",
        parts=[{"type": "text", "text": "hi"}],
        position=0,
    )
    return conversation


def add_assistant(conversation: Conversation, *parts: dict[str, Any]) -> Message:
    return Message.objects.create(
        conversation=conversation, message_id="a1", role="assistant", parts=list(parts), position=1
    )


def result(call: str, *, auto: bool = True) -> dict[str, Any]:
    return {
        "kind": "result",
        "toolCallId": call,
        "state": "output-available",
        "output": 7,
        "autoContinue": auto,
    }


def test_the_last_answer_of_a_batch_starts_one_continuation(conversation: Conversation) -> None:
    add_assistant(conversation, part("input-available", "c1"), part("input-available", "c2"))
    first = interaction_apply(conversation_id=conversation.pk, update=result("c1"))
    assert first.status == "applied" and first.continuation_request_id is None, "c2 still waits"
    second = interaction_apply(conversation_id=conversation.pk, update=result("c2", auto=False))
    assert second.continuation_request_id, "a sibling asked for it, so the batch continues"
    fiber = Fiber.objects.get(request_id=second.continuation_request_id)
    assert (
        fiber.kind == TurnKind.CONTINUE and FiberSnapshot.from_json(fiber.snapshot).turn.continuation is True
    )
    again = interaction_apply(conversation_id=conversation.pk, update=result("c2"))
    assert again.status == "noop" and again.message is None
    assert Fiber.objects.filter(conversation=conversation).count() == 1


def test_no_continuation_when_nobody_asked_for_one(conversation: Conversation) -> None:
    add_assistant(conversation, part("input-available", "c1"))
    applied = interaction_apply(conversation_id=conversation.pk, update=result("c1", auto=False))
    assert applied.status == "applied" and applied.continuation_request_id is None
    assert not Fiber.objects.filter(conversation=conversation).exists()


def test_an_answer_for_an_unknown_call_is_dropped_when_no_turn_runs(conversation: Conversation) -> None:
    outcome = interaction_apply(conversation_id=conversation.pk, update=result("nope"))
    assert outcome.status == "unknown"
    conversation.refresh_from_db()
    assert conversation.tool_updates == []


def test_an_answer_that_beats_its_turn_to_the_database_is_applied_when_the_turn_stores_its_message(
    conversation: Conversation,
) -> None:
    fiber = Fiber.objects.create(conversation=conversation, request_id="r1", status=Fiber.Status.RUNNING)
    stream_calls(fiber, "c1")
    outcome = interaction_apply(conversation_id=conversation.pk, update=result("c1"))
    assert outcome.status == "buffered"
    add_assistant(conversation, part("input-available", "c1"))  # the turn stores its message
    Fiber.objects.filter(request_id="r1").update(status=Fiber.Status.COMPLETED)
    conversation.refresh_from_db()
    interactions_settle(conversation)
    conversation.save()
    stored = Message.objects.get(message_id="a1")
    assert stored.parts[0]["state"] == "output-available" and stored.parts[0]["output"] == 7
    assert conversation.tool_updates == []
    assert Fiber.objects.filter(conversation=conversation, kind=TurnKind.CONTINUE).count() == 1


def server_result(call: str, output: Any = "sent; the user is an admin") -> dict[str, Any]:
    """A client's result for a call of the agent's server tool `x`, as the consumer passes it."""
    return {**result(call), "output": output, "serverTools": ["x"]}


@pytest.mark.parametrize("state", ["approval-requested", "approval-responded", "input-available"])
def test_a_client_never_writes_a_server_tools_output(conversation: Conversation, state: str) -> None:
    """A server tool waiting for approval, approved and about to run, or left without an output by an
    interruption: a client's result for it is refused, the part is left as it was, nothing continues."""
    waiting = part(state, "c1", approval={"id": "ap-1"})
    add_assistant(conversation, waiting)
    outcome = interaction_apply(conversation_id=conversation.pk, update=server_result("c1"))
    assert (outcome.status, outcome.message, outcome.continuation_request_id) == ("refused", None, None)
    assert Message.objects.get(message_id="a1").parts == [waiting]
    conversation.refresh_from_db()
    assert conversation.continue_armed == ""
    assert not Fiber.objects.filter(conversation=conversation).exists()


def test_a_client_never_answers_an_mcp_tools_call(conversation: Conversation) -> None:
    """An MCP server's tool is known only to the worker, which marks its calls `dynamic-tool`: a client's
    result for one is refused though the web process cannot list the server's tools."""
    waiting = {"type": "dynamic-tool", "toolName": "shop_add", "toolCallId": "c1", "state": "input-available"}
    add_assistant(conversation, {**waiting, "input": {"a": 1}})
    outcome = interaction_apply(conversation_id=conversation.pk, update=result("c1"))
    assert (outcome.status, outcome.continuation_request_id) == ("refused", None)
    assert Message.objects.get(message_id="a1").parts == [{**waiting, "input": {"a": 1}}]
    assert not Fiber.objects.filter(conversation=conversation).exists()


def test_a_client_tools_result_is_still_taken_beside_a_server_tool(conversation: Conversation) -> None:
    client_call = {**part("input-available", "c2"), "type": "tool-ask_user"}
    add_assistant(conversation, part("output-available", "c1", output=1), client_call)
    outcome = interaction_apply(conversation_id=conversation.pk, update=server_result("c2", output="Ada"))
    assert outcome.status == "applied" and outcome.continuation_request_id
    assert Message.objects.get(message_id="a1").parts[1]["output"] == "Ada"


def test_a_buffered_result_for_a_server_tool_is_refused_when_its_turn_stores_the_call(
    conversation: Conversation,
) -> None:
    """Sent while the turn runs (the call not stored yet), applied when the turn finishes: refused then."""
    fiber = Fiber.objects.create(conversation=conversation, request_id="r1", status=Fiber.Status.RUNNING)
    stream_calls(fiber, "c1")
    assert interaction_apply(conversation_id=conversation.pk, update=server_result("c1")).status == "buffered"
    waiting = part("approval-requested", "c1", approval={"id": "ap-1"})
    add_assistant(conversation, waiting)
    Fiber.objects.filter(request_id="r1").update(status=Fiber.Status.COMPLETED)
    conversation.refresh_from_db()
    interactions_settle(conversation)
    conversation.save()
    assert Message.objects.get(message_id="a1").parts == [waiting]
    assert not Fiber.objects.filter(conversation=conversation, kind=TurnKind.CONTINUE).exists()


# -- through the socket -------------------------------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("frame_type", ["cf_agent_tool_approval", "cf_agent_tool_result"])
async def test_every_tab_hears_of_the_answer_before_its_continuation_is_sent_to_a_worker(
    frame_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stored message goes out before the continuation can stream into it. Published after the
    continuation was sent (as it once was), a web process slower than the worker delivered the stored
    copy after the continuation's text, and the page replaced the message with it (a CI flake of
    tests/e2e/test_page.py)."""
    import json

    from channels.layers import get_channel_layer

    import chat.transcript.turns
    from chat import protocol as p
    from tests.chat.sockets import connected, new_name, receive_until, seed_conversation

    events: list[str] = []
    layer = get_channel_layer()
    assert layer is not None
    group_send = layer.group_send

    async def recorded_group_send(group: str, message: dict[str, Any]) -> None:
        await group_send(group, message)
        if message.get("type") == "think.broadcast":
            events.append(json.loads(message["frame"])["type"])

    monkeypatch.setattr(layer, "group_send", recorded_group_send)
    monkeypatch.setattr(chat.transcript.turns, "turn_send", lambda fiber_id: events.append("turn sent"))
    name = new_name("answer-order")
    waiting = "approval-requested" if frame_type == "cf_agent_tool_approval" else "input-available"
    await seed_conversation(
        name,
        [
            {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]},
            {"id": "a1", "role": "assistant", "parts": [part(waiting, "c1")]},
        ],
    )
    answer: dict[str, Any] = {"type": frame_type, "toolCallId": "c1", "autoContinue": True}
    answer.update({"approved": True} if frame_type == "cf_agent_tool_approval" else {"output": 7})
    async with connected(name) as client:
        await client.send_to(text_data=json.dumps(answer))
        frames = await receive_until(client, lambda frame: frame["type"] == p.MESSAGE_UPDATED)
    assert frames[-1]["message"]["id"] == "a1"
    assert events == [p.MESSAGE_UPDATED, "turn sent"], "the update first, then the continuation"
