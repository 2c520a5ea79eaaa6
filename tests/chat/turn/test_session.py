"""Sessions and compaction: overlays over the stored transcript, and the ready compaction function."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from chat.agents import CompactionResult, Think, create_compact_function
from chat.models import Compaction, Conversation, Message
from chat.transcript.compaction import compaction_store, estimate_tokens, render_transcript
from chat.transcript.selectors import messages_list
from chat.transcript.services import conversation_clear

pytestmark = pytest.mark.django_db(transaction=True)


def conversation_with(count: int) -> Conversation:
    conversation = Conversation.objects.create(agent="assistant", name=f"c-{count}-{id(object())}")
    for i in range(count):
        role = "user" if i % 2 == 0 else "assistant"
        Message.objects.create(
            conversation=conversation,
            message_id=f"m{i}",
            role=role,
            parts=[{"type": "text", "text": f"message {i} " + "words " * 20}],
            position=i,
        )
    return conversation


def ids(messages: list[dict[str, Any]]) -> list[str]:
    return [m["id"] for m in messages]


def test_an_overlay_shows_its_summary_in_place_of_its_range_and_keeps_the_messages() -> None:
    conversation = conversation_with(6)
    overlay = compaction_store(
        conversation_id=conversation.pk, result=CompactionResult("m1", "m3", "They talked about words.")
    )
    assert overlay is not None
    visible = messages_list(conversation_id=conversation.pk)
    assert ids(visible) == ["m0", f"compaction_{overlay.compaction_id}", "m4", "m5"]
    assert visible[1] == {
        "id": f"compaction_{overlay.compaction_id}",
        "role": "assistant",
        "parts": [{"type": "text", "text": "They talked about words."}],
    }
    assert ids(messages_list(conversation_id=conversation.pk, raw=True)) == [f"m{i}" for i in range(6)]


def test_a_new_compaction_from_a_summary_extends_the_earlier_overlay() -> None:
    conversation = conversation_with(8)
    first = compaction_store(conversation_id=conversation.pk, result=CompactionResult("m1", "m3", "first"))
    assert first is not None
    second = compaction_store(
        conversation_id=conversation.pk, result=CompactionResult(first.message_id, "m5", "first and more")
    )
    assert second is not None and (second.from_message_id, second.to_message_id) == ("m1", "m5")
    assert Compaction.objects.filter(conversation=conversation).count() == 1, (
        "the covered overlay is replaced"
    )
    assert ids(messages_list(conversation_id=conversation.pk)) == ["m0", second.message_id, "m6", "m7"]


def test_an_unknown_or_reversed_range_stores_nothing() -> None:
    conversation = conversation_with(4)
    assert (
        compaction_store(conversation_id=conversation.pk, result=CompactionResult("m1", "nope", "x")) is None
    )
    assert compaction_store(conversation_id=conversation.pk, result=CompactionResult("m3", "m1", "x")) is None
    assert not Compaction.objects.filter(conversation=conversation).exists()


def test_clear_removes_overlays_and_clients_echoing_a_summary_do_not_store_it() -> None:
    from chat.protocol import ChatRequest
    from chat.transcript.turns import turn_accept

    conversation = conversation_with(4)
    overlay = compaction_store(conversation_id=conversation.pk, result=CompactionResult("m1", "m2", "sum"))
    echoed = [*messages_list(conversation_id=conversation.pk), {"id": "u9", "role": "user", "parts": []}]
    turn_accept(conversation_id=conversation.pk, request=ChatRequest("r1", echoed, "submit-message"))
    stored = list(Message.objects.filter(conversation=conversation).values_list("message_id", flat=True))
    assert overlay is not None and overlay.message_id not in stored and "u9" in stored
    conversation_clear(conversation_id=conversation.pk)
    assert not Compaction.objects.filter(conversation=conversation).exists()


class Compacting(Think):
    def configure_session(self, session: Any) -> None:
        session.on_compaction(
            create_compact_function(summarize=lambda msgs, ctx: f"{len(msgs)} summarised", tail_tokens=100)
        )


def test_session_compact_runs_the_registered_function() -> None:
    conversation = conversation_with(10)
    agent = Compacting(agent="assistant", name=conversation.name, conversation_id=conversation.pk)
    assert agent.session is agent.session, "configured once per instance"
    overlay = asyncio.run(agent.session.compact())
    assert overlay is not None and overlay.from_message_id == "m3"
    visible = messages_list(conversation_id=conversation.pk)
    assert ids(visible)[:3] == ["m0", "m1", "m2"], "the head is protected"
    assert visible[3]["parts"][0]["text"].endswith("summarised")
    assert visible[4]["role"] == "user", "the tail starts at a user message"


def test_compact_without_a_function_is_an_error_and_a_raising_function_is_a_no_op() -> None:
    conversation = conversation_with(4)
    plain = Think(agent="assistant", name=conversation.name, conversation_id=conversation.pk)
    with pytest.raises(RuntimeError, match="on_compaction"):
        asyncio.run(plain.session.compact())

    def broken(messages: Any, ctx: Any) -> None:
        raise ValueError("bug")

    plain.session.on_compaction(broken)
    assert asyncio.run(plain.session.compact()) is None


def messages(*roles_and_sizes: tuple[str, int]) -> list[dict[str, Any]]:
    return [
        {"id": f"m{i}", "role": role, "parts": [{"type": "text", "text": "x" * size}]}
        for i, (role, size) in enumerate(roles_and_sizes)
    ]


async def summarize(msgs: list[dict[str, Any]], ctx: Any) -> str:
    return ",".join(m["id"] for m in msgs)


def run(fn: Any, history: list[dict[str, Any]]) -> CompactionResult | None:
    ctx = type("Ctx", (), {"token_counter": staticmethod(estimate_tokens), "agent": None})()
    return asyncio.run(fn(history, ctx))  # type: ignore[no-any-return]


def test_the_ready_function_keeps_head_and_a_tail_within_its_budget() -> None:
    history = messages(*[("user" if i % 2 == 0 else "assistant", 400) for i in range(12)])
    fn = create_compact_function(summarize=summarize, protect_head=2, tail_tokens=350, min_tail_messages=2)
    result = run(fn, history)
    assert result is not None
    assert (result.from_message_id, result.to_message_id) == ("m2", "m7")
    assert result.summary == "m2,m3,m4,m5,m6,m7"


def test_the_ready_function_has_nothing_to_do_on_a_short_history() -> None:
    fn = create_compact_function(summarize=summarize, protect_head=3, min_tail_messages=2)
    assert run(fn, messages(("user", 10), ("assistant", 10), ("user", 10), ("assistant", 10))) is None


def test_invalid_options_are_refused() -> None:
    with pytest.raises(ValueError, match="min_tail_messages"):
        create_compact_function(min_tail_messages=0)


def test_the_summariser_reads_text_and_tool_calls_one_line_per_message() -> None:
    history = [
        {"id": "u", "role": "user", "parts": [{"type": "text", "text": "weather\\nplease"}]},
        {
            "id": "a",
            "role": "assistant",
            "parts": [{"type": "tool-weather", "toolCallId": "c", "input": {"city": "Oslo"}, "output": 3}],
        },
    ]
    assert render_transcript(history).splitlines() == [
        "user: weather\\nplease",
        'assistant: [tool weather({"city": "Oslo"}) -> 3]',
    ]
