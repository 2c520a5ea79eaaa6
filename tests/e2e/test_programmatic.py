"""Programmatic entry paths with a real worker: save_messages, continue_last_turn, chat() and stash()."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.agents import Think, open_agent
from chat.exceptions import ConversationBusy
from chat.transcript.snapshot import FiberSnapshot, TurnKind
from recovery.models import Fiber, Stream
from recovery.stream.buffer import stream_chunks
from tests.support import TEST_PRINCIPAL, ChatClient, assistant_text, chat_request, numbers, user_message

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("in_process_model"),
]


def new_agent(agent: str = "assistant") -> Think:
    return open_agent(agent, f"p-{uuid.uuid4().hex[:10]}", owner=TEST_PRINCIPAL)


def texts(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [
        (m["role"], "".join(p.get("text", "") for p in m["parts"] if p["type"] == "text")) for m in messages
    ]


async def test_save_messages_runs_a_turn_inside_a_fiber(stack: Any) -> None:
    agent = await sync_to_async(new_agent)()
    result = await sync_to_async(agent.save_messages)(["count to 5"], timeout=30)
    assert result.status == "completed" and result.request_id
    messages = await sync_to_async(agent.messages)()
    assert texts(messages) == [("user", "count to 5"), ("assistant", numbers(5))]
    fiber = await Fiber.objects.aget(request_id=result.request_id)
    assert fiber.kind == TurnKind.PROGRAMMATIC and fiber.status == Fiber.Status.COMPLETED
    assert FiberSnapshot.from_json(fiber.snapshot).turn.continuation is False
    assert FiberSnapshot.from_json(fiber.snapshot).turn.latest_user_message_id == messages[0]["id"], (
        "snapshot written first"
    )


async def test_save_messages_with_a_function_sees_the_transcript_its_turn_continues(stack: Any) -> None:
    agent = await sync_to_async(new_agent)()
    async with ChatClient(stack.port, agent.name) as client:
        await client.send(chat_request("ws-1", [user_message("count to 30 [rate 30]")]))
        await client.recv_type("cf_agent_use_chat_response")  # the WebSocket turn is streaming
        seen: list[int] = []

        def next_messages(current: list[dict[str, Any]]) -> list[str]:
            seen.append(len(current))
            return [f"count to {len(current)}"]

        result = await sync_to_async(agent.save_messages)(next_messages, timeout=30)
    assert seen == [2], "the function ran once the running turn had stored its answer"
    assert result.status == "completed"
    messages = await sync_to_async(agent.messages)()
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert texts(messages)[3] == ("assistant", numbers(2))


async def test_save_messages_without_waiting_and_bad_input(stack: Any) -> None:
    agent = await sync_to_async(new_agent)()
    with pytest.raises(ValueError, match="non-empty list"):
        await sync_to_async(agent.save_messages)([])
    with pytest.raises(ValueError, match="role"):
        await sync_to_async(agent.save_messages)([{"role": "robot", "parts": []}])
    assert await sync_to_async(agent.messages)() == [], "refused input writes nothing"
    started = await sync_to_async(agent.save_messages)(["count to 3"], wait=False)
    assert started.status == "accepted"
    with pytest.raises(ConversationBusy):
        await sync_to_async(agent.save_messages)(["count to 3"], timeout=0)
    from chat.handle import turn_wait

    done = await sync_to_async(turn_wait)(
        conversation_id=agent.conversation_id, request_id=started.request_id, timeout=30
    )
    assert done.status == "completed"


async def test_continue_last_turn_skips_unless_the_leaf_is_an_assistant_message(
    stack: Any, scripted_model: Any
) -> None:
    agent = await sync_to_async(new_agent)()
    skipped = await sync_to_async(agent.continue_last_turn)()
    assert (skipped.request_id, skipped.status) == ("", "skipped")
    await sync_to_async(stored_exchange)(agent, "count to 6", "1 2 3")  # an answer cut short
    result = await sync_to_async(agent.continue_last_turn)({"custom": 1}, wait=True, timeout=30)
    assert result.status == "completed"
    fiber = await Fiber.objects.aget(request_id=result.request_id)
    assert fiber.kind == TurnKind.CONTINUE
    assert FiberSnapshot.from_json(fiber.snapshot).turn.continuation is True
    assert FiberSnapshot.from_json(fiber.snapshot).turn.last_body == {"custom": 1}, (
        "a custom body is the request context"
    )
    stream = await Stream.objects.aget(request_id=result.request_id)
    assert stream.is_continuation
    last_request = scripted_model.chats[-1]
    assert last_request[-1]["role"] == "user" and last_request[-1]["content"].startswith("Continue your")
    assert last_request[-2] == {"role": "assistant", "content": "1 2 3"}
    messages = await sync_to_async(agent.messages)()
    # The continuation extended the answer it continued: one message, its parts in order.
    assert texts(messages) == [("user", "count to 6"), ("assistant", "1 2 3 4 5 6")]
    assert messages[1]["id"] == "assistant-1" and stream.message_id == "assistant-1"
    assert [p.get("text") for p in messages[1]["parts"] if p["type"] == "text"] == ["1 2 3", " 4 5 6"]


def stored_exchange(agent: Think, question: str, answer: str) -> None:
    from chat.models import Message

    for position, (role, text) in enumerate([("user", question), ("assistant", answer)]):
        Message.objects.create(
            conversation_id=agent.conversation_id,
            message_id=f"{role}-{position}",
            role=role,
            parts=[{"type": "text", "text": text}],
            position=position,
        )


async def test_chat_streams_every_chunk_to_a_callback_and_records_them(stack: Any) -> None:
    agent = await sync_to_async(new_agent)()
    chunks: list[dict[str, Any]] = []
    result = await agent.achat(["count to 4"], on_chunk=chunks.append, timeout=30)
    assert result.status == "completed" and result.text == numbers(4)
    assert [c["type"] for c in chunks][:2] == ["start", "start-step"] and chunks[-1]["type"] == "finish"
    assert "".join(c.get("delta", "") for c in chunks) == numbers(4)
    stream = await Stream.objects.aget(request_id=result.request_id)
    stored = [json.loads(body) for _, body in await sync_to_async(stream_chunks)(stream.pk)]
    # Every chunk was recorded for replay (consecutive deltas of one part coalesced into one chunk).
    kinds = [c["type"] for c in stored]
    assert list(dict.fromkeys(kinds)) == list(dict.fromkeys(c["type"] for c in chunks))
    assert "".join(c.get("delta", "") for c in stored) == numbers(4) and len(stored) < len(chunks)
    fiber = await Fiber.objects.aget(request_id=result.request_id)
    assert fiber.status == Fiber.Status.COMPLETED and fiber.kind == TurnKind.PROGRAMMATIC
    messages = await sync_to_async(agent.messages)()
    assert assistant_text(messages) == numbers(4) and result.message == messages[-1]


async def test_chat_accepts_an_async_callback(stack: Any) -> None:
    agent = await sync_to_async(new_agent)()
    seen: list[str] = []

    async def on_chunk(chunk: dict[str, Any]) -> None:
        seen.append(chunk["type"])

    result = await agent.achat("count to 2", on_chunk=on_chunk, timeout=30)
    assert result.status == "completed" and "text-delta" in seen


@pytest.mark.parametrize("path", ["save_messages", "chat"])
async def test_stash_works_in_save_messages_and_chat_turns(stack: Any, path: str) -> None:
    agent = await sync_to_async(new_agent)("stash-agent")
    prompt = '[tool remember {"tag": "t", "note": "keep me"}]'
    if path == "chat":
        result = await agent.achat([prompt], timeout=30)
    else:
        result = await sync_to_async(agent.save_messages)([prompt], timeout=30)
    assert result.status == "completed"
    fiber = await Fiber.objects.aget(request_id=result.request_id)
    assert fiber.snapshot["user"] == {"tag": "t", "note": "keep me"}
    assert FiberSnapshot.from_json(fiber.snapshot).turn.request_id == result.request_id, (
        "the turn's own snapshot is kept"
    )


def test_stash_outside_a_turn_is_an_error() -> None:
    agent = Think(agent="assistant", name="x", conversation_id=1)
    with pytest.raises(RuntimeError, match="only available while a turn"):
        agent.stash({"a": 1})


async def test_sequential_turns_leave_no_fiber_behind(stack: Any) -> None:
    agent = await sync_to_async(new_agent)()
    for n in range(1, 4):
        assert (await sync_to_async(agent.save_messages)([f"count to {n}"], timeout=30)).status == "completed"
    await agent.achat(["count to 2"], timeout=30)
    fibers = Fiber.objects.filter(conversation_id=agent.conversation_id)
    assert await fibers.acount() == 4
    assert await fibers.exclude(status=Fiber.Status.COMPLETED).acount() == 0
