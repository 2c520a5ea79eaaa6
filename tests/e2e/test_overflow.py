"""Context overflow end to end: a scripted model with a small
context window, reached through litellm; reactive recovery through a real worker over the WebSocket,
and the programmatic path (chat()) in this process, where the diagnostic events can be watched."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.agents import open_agent
from chat.models import Compaction, Message
from recovery.observe import diagnostics
from tests.agents import probe_key, probe_redis
from tests.support import FILLER, TEST_PRINCIPAL, ChatClient, chat_request, numbers, seed, user_message

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

HISTORY_MESSAGES = 6  # what `seed` stores


def requests_for(scripted_model: Any, prompt: str) -> list[dict[str, Any]]:
    """The model calls of a turn (not its summarisation calls)."""
    return [{"messages": c} for c in scripted_model.chats if any(m.get("content") == prompt for m in c)]


def summary_requests(scripted_model: Any, since: int) -> list[dict[str, Any]]:
    return [{"messages": c} for c in scripted_model.chats[since:] if c[0].get("role") == "system"]


def chat_errors(name: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in probe_redis().lrange(probe_key("chat-error", name), 0, -1)]


async def ws_turn(port: int, agent: str, name: str, prompt: str) -> tuple[list[dict[str, Any]], Any]:
    async with ChatClient(port, name, agent) as client:
        await client.send(chat_request("req-1", [user_message(prompt, "prompt-1")]))
        log = await client.follow("req-1", timeout=30)
        frames = [f for f in client.frames if f.get("id") == "req-1"]
    return frames, log


async def test_recovers_a_context_overflow_on_the_websocket_turn_path(
    stack: Any, scripted_model: Any
) -> None:
    name = f"o-{uuid.uuid4().hex[:8]}"
    await sync_to_async(seed)("reactive-agent", name)
    prompt = f"count to 5 [window 200] {name}"
    before = len(scripted_model.requests)
    frames, log = await ws_turn(stack.port, "reactive-agent", name, prompt)

    assert [f for f in frames if f.get("error")] == [], "no error frame"
    assert [f for f in frames if f.get("done")] == [log.done], "exactly one clean done"
    assert log.done["outcome"] == "completed" and log.text == numbers(5)
    starts = [c for _, c in log.chunks if c["type"] == "start"]
    assert len(starts) == 2 and starts[0]["messageId"] != starts[1]["messageId"], "attempt 2 is a new message"
    seqs = log.seqs
    assert seqs == list(range(len(seqs))), "one request id, one seq sequence across both attempts"
    calls = requests_for(scripted_model, prompt)
    assert len(calls) == 2 and len(summary_requests(scripted_model, before)) == 1
    assert all(r["messages"][0]["role"] != "system" for r in calls)

    raw = await sync_to_async(
        lambda: list(Message.objects.filter(conversation__name=name).order_by("position"))
    )()
    assert [m.message_id for m in raw][: HISTORY_MESSAGES + 1] == [*(f"h{i}" for i in range(6)), "prompt-1"]
    assert len(raw) == HISTORY_MESSAGES + 2 and raw[-1].message_id == starts[1]["messageId"], (
        "the messages stay, no orphan of attempt 1"
    )
    compaction = await Compaction.objects.aget(conversation__name=name)
    assert (compaction.from_message_id, compaction.to_message_id) == ("h1", "h5")
    assert compaction.summary == "Summary of 5 lines."
    visible = calls[1]["messages"]
    assert [m["content"] for m in visible] == [f"0: {FILLER}", "Summary of 5 lines.", prompt]


async def test_stays_terminal_when_disabled(stack: Any, scripted_model: Any) -> None:
    name = f"o-{uuid.uuid4().hex[:8]}"
    await sync_to_async(seed)("tool-agent", name)  # an agent without context_overflow
    prompt = f"count to 5 [window 200] {name}"
    frames, log = await ws_turn(stack.port, "tool-agent", name, prompt)
    # The overflow by its class and a fault id; the provider's own text is in the Fault row and the log.
    [error] = log.errors
    assert re.fullmatch(
        r"The model provider rejected the request: context window exceeded \(error [0-9a-f]{8}\)", error
    )
    assert len(requests_for(scripted_model, prompt)) == 1
    assert not await Compaction.objects.filter(conversation__name=name).aexists()


async def test_falls_through_to_a_terminal_error_via_on_chat_error_when_compaction_cannot_shorten(
    stack: Any, scripted_model: Any
) -> None:
    name = f"o-{uuid.uuid4().hex[:8]}"
    prompt = f"count to 5 [window 5] {name}"
    frames, log = await ws_turn(stack.port, "reactive-agent", name, prompt)
    assert log.errors == ["Sorry, that conversation got too long (context_overflow)."]
    assert await sync_to_async(chat_errors)(name) == [
        {"classification": "context_overflow", "stage": "stream", "request_id": "req-1"}
    ]
    assert len(requests_for(scripted_model, prompt)) == 1
    roles = await sync_to_async(
        lambda: list(Message.objects.filter(conversation__name=name).values_list("role", flat=True))
    )()
    assert roles == ["user"], "no partial is kept"


async def test_stops_after_max_retries_when_the_overflow_persists(stack: Any, scripted_model: Any) -> None:
    name = f"o-{uuid.uuid4().hex[:8]}"
    await sync_to_async(seed)("reactive-agent", name)
    prompt = f"count to 5 [window 60] {name}"  # still too long once compacted
    before = len(scripted_model.requests)
    frames, log = await ws_turn(stack.port, "reactive-agent", name, prompt)
    assert log.errors == ["Sorry, that conversation got too long (context_overflow)."]
    assert len(requests_for(scripted_model, prompt)) == 2, "one retry, never a loop"
    assert len(summary_requests(scripted_model, before)) == 1
    assert await Compaction.objects.filter(conversation__name=name).acount() == 1


@pytest.fixture
def compacted_events() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def keep(event: dict[str, Any]) -> None:
        if event["type"] == "chat:context:compacted":
            seen.append(event["payload"])

    unsubscribe = diagnostics.subscribe("chat", keep)
    yield seen
    unsubscribe()


@pytest.mark.usefixtures("in_process_model")
async def test_recovers_a_context_overflow_on_the_programmatic_path(
    compacted_events: list[dict[str, Any]], scripted_model: Any
) -> None:
    name = f"o-{uuid.uuid4().hex[:8]}"
    await sync_to_async(seed)("reactive-agent", name)
    agent = await sync_to_async(open_agent)("reactive-agent", name)
    result = await agent.achat([f"count to 3 [window 200] {name}"], timeout=30)
    assert result.status == "completed" and result.text == numbers(3)
    [payload] = compacted_events
    assert payload == {"reason": "reactive", "shortened": True, "attempt": 1, "requestId": result.request_id}


@pytest.mark.usefixtures("in_process_model")
async def test_proactive_guard_compacts_mid_turn_before_the_budget_is_exceeded(
    compacted_events: list[dict[str, Any]], scripted_model: Any
) -> None:
    name = f"o-{uuid.uuid4().hex[:8]}"
    await sync_to_async(seed)("proactive-agent", name)
    agent = await sync_to_async(open_agent)("proactive-agent", name)
    prompt = f'[tool add {{"tag": "{name}", "a": 1, "b": 2}}]'
    result = await agent.achat([prompt], timeout=30)
    assert result.status == "completed" and result.text == "Tool add returned: 3"
    assert compacted_events == [{"reason": "proactive", "shortened": True}]
    step1, step2 = requests_for(scripted_model, prompt)
    assert (
        step1["messages"][1]["content"].startswith("1: ") and len(step1["messages"]) == HISTORY_MESSAGES + 1
    )
    contents = [m.get("content") for m in step2["messages"]]
    assert contents[:3] == [f"0: {FILLER}", "Summary of 5 lines.", prompt], "compacted head"
    assert [m["role"] for m in step2["messages"][3:]] == ["assistant", "tool"], (
        "this turn's step spliced back on"
    )


@pytest.mark.usefixtures("in_process_model")
async def test_proactive_no_op_compaction_consumes_its_single_slot(
    compacted_events: list[dict[str, Any]], scripted_model: Any
) -> None:
    name = f"o-{uuid.uuid4().hex[:8]}"
    agent = await sync_to_async(open_agent)("proactive-agent", name)
    prompt = (
        '[tool add {"tag": "noop", "a": 1, "b": 1} times 3] ' + FILLER * 8
    )  # one long message: nothing to compact
    result = await agent.achat([prompt], timeout=30)
    assert result.status == "completed"
    assert len(requests_for(scripted_model, prompt)) == 4, "three tool steps and the answer"
    assert compacted_events == [{"reason": "proactive", "shortened": False}], "one attempt, never again"


@pytest.mark.usefixtures("in_process_model")
async def test_recovers_with_both_layers(compacted_events: list[dict[str, Any]], scripted_model: Any) -> None:
    name = f"o-{uuid.uuid4().hex[:8]}"
    await sync_to_async(seed)("both-layers-agent", name)
    agent = await sync_to_async(open_agent)("both-layers-agent", name)
    prompt = f'[window 200] [tool add {{"tag": "{name}", "a": 2, "b": 2}}]'
    result = await agent.achat([prompt], timeout=30)
    assert result.status == "completed" and result.text == "Tool add returned: 4"
    assert [e["reason"] for e in compacted_events] == ["reactive"], (
        "the compacted history kept the steps small"
    )
    assert len(requests_for(scripted_model, prompt)) == 3, "overflow, then the tool step and the answer"


@pytest.mark.parametrize("path", ["save_messages", "submit_messages"])
def test_recovers_a_context_overflow_on_the_durable_programmatic_paths(
    stack: Any, scripted_model: Any, path: str
) -> None:
    from tests.support import wait_until

    name = f"o-{uuid.uuid4().hex[:8]}"
    seed("reactive-agent", name)
    agent = open_agent("reactive-agent", name, owner=TEST_PRINCIPAL)
    prompt = f"count to 4 [window 200] {name}"
    if path == "save_messages":
        assert agent.save_messages([prompt], timeout=30).status == "completed"
    else:
        submitted = agent.submit_messages([prompt])
        wait_until(
            lambda: agent.get_submission(submitted.submission_id).status == "completed", 30, "completion"
        )
    assert len(requests_for(scripted_model, prompt)) == 2
    assert Compaction.objects.filter(conversation__name=name).count() == 1
    visible = agent.messages()
    assert visible[1]["id"].startswith("compaction_") and visible[-1]["parts"][-1]["text"] == numbers(4)
