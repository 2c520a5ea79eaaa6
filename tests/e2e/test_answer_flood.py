"""Issue 34, row 2, over a real daphne: answers sent while a turn runs wait in one JSON column, and a
client may not fill it. Made-up tool calls with big outputs from several sockets are refused, each with
a cf_agent_tool_refused frame, and nothing of them is stored."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

from chat.models import Conversation
from tests.support import ChatClient, chat_request, numbers, user_message

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

OUTPUT = "x" * 250_000  # just under MAX_TOOL_OUTPUT_BYTES (256,000)
TOOLS = [{"name": f"tool_{n}", "description": "y" * 9_000} for n in range(10)]  # ~90 KB, under 100,000


def forged(call: str, **extra: Any) -> str:
    return json.dumps(
        {"type": "cf_agent_tool_result", "toolCallId": call, "toolName": "get_location", "output": OUTPUT}
        | extra
    )


async def refusals(client: ChatClient, count: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    while len(found) < count:
        frame = await client.recv_type("cf_agent_tool_refused", timeout=30)
        found.append(frame)
    return found


async def test_made_up_answers_during_a_slow_turn_are_refused_and_nothing_is_buffered(stack: Any) -> None:
    name = f"flood-{uuid.uuid4().hex[:10]}"
    async with ChatClient(stack.port, name) as owner:
        await owner.recv_type("cf_agent_identity")
        await owner.send(chat_request("slow", [user_message("count to 150 [rate 25]")]))
        await owner.follow("slow", stop_after=3, timeout=30)  # the turn runs
        attackers = [ChatClient(stack.port, name) for _ in range(3)]
        for attacker in attackers:
            await attacker.__aenter__()
        try:
            for attacker in attackers:
                await attacker.recv_type("cf_agent_identity")
            calls = {
                attacker: [f"made-up-{uuid.uuid4().hex[:6]}" for _ in range(4)] for attacker in attackers
            }
            for attacker, ids in calls.items():
                for call in ids:
                    await attacker.send(forged(call, clientTools=TOOLS))
                # ~700 KB of schemas: refused by its size before anything is looked up
                await attacker.send(forged(ids[0], clientTools=TOOLS * 8))
            answers = await asyncio.gather(*(refusals(a, len(ids) + 1) for a, ids in calls.items()))
            conversation = await Conversation.objects.aget(name=name)
            assert conversation.tool_updates == [] and conversation.last_client_tools is None
        finally:
            for attacker in attackers:
                await attacker.__aexit__(None, None, None)
        log = await owner.follow("slow", timeout=60)
    for ids, refused in zip(calls.values(), answers, strict=True):
        assert [f["toolCallId"] for f in refused] == [*ids, ids[0]]
        assert {f["reason"] for f in refused[:-1]} == {
            f"no turn of this conversation called tool call {call!r}" for call in ids
        }
        assert refused[-1]["reason"] == "'clientTools' is larger than 100000 bytes"
    assert log.errors == [] and numbers(150) in log.text
