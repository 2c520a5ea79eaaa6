"""Answers that come while their turn runs wait in one JSON column (chat.transcript.interactions): only
for a call the running turn streamed, and within a count and a size per conversation (issue 34, row 2)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from chat.exceptions import AnswerRefused
from chat.models import Conversation, Message
from chat.protocol import LimitExceeded, Limits, ProtocolError, parse_frame
from chat.transcript.finish import interactions_settle
from chat.transcript.interactions import interaction_apply
from recovery.models import Fiber, Segment, Stream
from tests.chat.wire.test_limits import think


@pytest.fixture
def running(db: Any) -> tuple[Conversation, Fiber]:
    conversation = Conversation.objects.create(agent="assistant", name="buffer")
    Message.objects.create(conversation=conversation, message_id="u1", role="user", parts=[], position=0)
    fiber = Fiber.objects.create(conversation=conversation, request_id="r1", status=Fiber.Status.RUNNING)
    return conversation, fiber


def stream_calls(fiber: Fiber, *calls: str) -> None:
    """The running turn streams a client tool's call for each id (stored before a client sees it)."""
    stream = Stream.objects.create(conversation_id=fiber.conversation_id, fiber=fiber, request_id="r1")
    chunks = [
        {"type": "tool-input-available", "toolCallId": call, "toolName": "ask_user", "input": {}}
        for call in calls
    ]
    body = "\n".join(json.dumps(c, separators=(",", ":")) for c in chunks)
    Segment.objects.create(stream=stream, seq_start=0, seq_end=len(chunks) - 1, body=body, fencing=0)


def answer(call: str, output: Any = "Ada", **extra: Any) -> dict[str, Any]:
    return {
        "kind": "result",
        "toolCallId": call,
        "state": "output-available",
        "output": output,
        "autoContinue": True,
        **extra,
    }


def test_an_answer_for_a_call_no_turn_streamed_is_refused_and_not_stored(
    running: tuple[Conversation, Fiber],
) -> None:
    conversation, fiber = running
    stream_calls(fiber, "c1")
    # A model's text that spells the key is escaped in its chunk: it is not a call.
    Segment.objects.create(
        stream=Stream.objects.get(fiber=fiber),
        seq_start=1,
        seq_end=1,
        fencing=0,
        body=json.dumps({"type": "text-delta", "id": "t", "delta": '"toolCallId":"made-up"'}),
    )
    tools = [{"name": "ask_user", "description": "x" * 100}]
    outcome = interaction_apply(conversation_id=conversation.pk, update=answer("made-up", clientTools=tools))
    assert (outcome.status, outcome.problem) == (
        "refused",
        "no turn of this conversation called tool call 'made-up'",
    )
    conversation.refresh_from_db()
    assert conversation.tool_updates == [] and conversation.last_client_tools is None


def test_the_buffer_holds_at_most_the_bound_of_answers(
    settings: Any, running: tuple[Conversation, Fiber]
) -> None:
    settings.THINK = think(MAX_BUFFERED_TOOL_UPDATES=2)
    conversation, fiber = running
    stream_calls(fiber, "c1", "c2", "c3")
    for call in ("c1", "c2"):
        assert interaction_apply(conversation_id=conversation.pk, update=answer(call)).status == "buffered"
    third = interaction_apply(conversation_id=conversation.pk, update=answer("c3"))
    assert (third.status, third.problem) == (
        "refused",
        "2 answers already wait for the running turn; send it when the turn has ended",
    )
    conversation.refresh_from_db()
    assert [u["toolCallId"] for u in conversation.tool_updates] == ["c1", "c2"]


def test_the_buffer_holds_at_most_the_bound_of_bytes(
    settings: Any, running: tuple[Conversation, Fiber]
) -> None:
    settings.THINK = think(MAX_BUFFERED_TOOL_UPDATE_BYTES=10_000)
    conversation, fiber = running
    stream_calls(fiber, "c1", "c2")
    tools = [{"name": "ask_user", "parameters": {"description": "y" * 50_000}}]
    first = answer("c1", "x" * 6_000, clientTools=tools)  # the schemas are not buffered with it
    assert interaction_apply(conversation_id=conversation.pk, update=first).status == "buffered"
    second = interaction_apply(conversation_id=conversation.pk, update=answer("c2", "x" * 6_000))
    assert (second.status, second.problem) == (
        "refused",
        "the answers waiting for the running turn would be larger than 10000 bytes; send it when the"
        " turn has ended",
    )
    conversation.refresh_from_db()
    assert [u["toolCallId"] for u in conversation.tool_updates] == ["c1"]
    assert "clientTools" not in conversation.tool_updates[0]
    assert conversation.last_client_tools == tools


def test_a_client_tools_answer_during_its_turn_still_waits_and_is_applied(
    running: tuple[Conversation, Fiber],
) -> None:
    conversation, fiber = running
    stream_calls(fiber, "c1")
    assert interaction_apply(conversation_id=conversation.pk, update=answer("c1")).status == "buffered"
    call = {"type": "tool-ask_user", "toolCallId": "c1", "state": "input-available", "input": {}}
    Message.objects.create(
        conversation=conversation, message_id="a1", role="assistant", parts=[call], position=1
    )
    Fiber.objects.filter(pk=fiber.pk).update(status=Fiber.Status.COMPLETED)
    conversation.refresh_from_db()
    interactions_settle(conversation)
    conversation.save()
    assert Message.objects.get(message_id="a1").parts[0]["output"] == "Ada"


def test_an_answer_for_no_call_at_all_stores_nothing(db: Any) -> None:
    """No turn runs and no message has the call: the answer and its schemas are dropped."""
    conversation = Conversation.objects.create(agent="assistant", name="idle")
    tools = [{"name": "ask_user"}]
    outcome = interaction_apply(conversation_id=conversation.pk, update=answer("made-up", clientTools=tools))
    assert outcome.status == "unknown"
    conversation.refresh_from_db()
    assert conversation.tool_updates == [] and conversation.last_client_tools is None


def tool_result_frame(**extra: Any) -> str:
    return json.dumps({"type": "cf_agent_tool_result", "toolCallId": "c1", "output": 1, **extra})


def test_client_tools_over_the_bound_are_refused_in_a_tool_result_and_a_chat_request() -> None:
    limits = Limits(max_client_tools_bytes=1_000)
    tools = [{"name": "ask_user", "description": "z" * 1_000}]
    with pytest.raises(AnswerRefused, match="'clientTools' is larger than 1000 bytes") as refused:
        parse_frame(tool_result_frame(clientTools=tools), limits)
    assert refused.value.tool_call_id == "c1"
    with pytest.raises(AnswerRefused, match="tool output is larger than 10 bytes"):
        parse_frame(tool_result_frame(output="x" * 20), Limits(max_tool_output_bytes=10))
    body = json.dumps({"messages": [], "clientTools": tools})
    request = json.dumps(
        {"type": "cf_agent_use_chat_request", "id": "r", "init": {"method": "POST", "body": body}}
    )
    with pytest.raises(LimitExceeded, match="'clientTools' is larger than 1000 bytes"):
        parse_frame(request, limits)
    assert parse_frame(tool_result_frame(clientTools=tools[:0]), limits) is not None
    with pytest.raises(ProtocolError):
        parse_frame(tool_result_frame(clientTools="no"), limits)
