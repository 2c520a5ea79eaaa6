"""Bounds on what one client can make the server do (issue 34), each attacked over a real daphne."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from chat.models import Conversation, Message
from recovery.models import Fiber
from tests.support import ChatClient, chat_request, numbers, user_message

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def new_name(prefix: str = "b") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def test_a_request_of_15000_new_messages_is_refused_and_another_visitor_is_answered(stack: Any) -> None:
    """A ~750 KB frame of 15,000 empty user messages (under the frame limit) asks for 15,000 rows on the
    web process's one database thread. It is refused whole (MAX_NEW_MESSAGES), nothing stored, and a
    second visitor's turn is answered."""
    attack_name, other_name = new_name("flood"), new_name("other")
    messages = [{"id": f"m{n:05}", "role": "user", "parts": []} for n in range(15_000)]
    frame = chat_request("flood", messages)
    assert 700_000 < len(frame.encode()) < 1_000_000
    async with ChatClient(stack.port, attack_name) as attacker, ChatClient(stack.port, other_name) as other:
        await attacker.recv_type("cf_agent_identity")
        await other.recv_type("cf_agent_identity")
        await attacker.send(frame)
        await other.send(chat_request("count", [user_message("count to 5")]))
        refusal = await attacker.follow("flood", timeout=30)
        answer = await other.follow("count", timeout=60)
    assert refusal.errors == [
        "Chat request refused: it adds 15000 new messages, more than the 100 one request may add;"
        " send them in smaller requests"
    ]
    assert answer.errors == [] and answer.text == numbers(5)
    conversation = await Conversation.objects.aget(name=attack_name)
    assert not await Message.objects.filter(conversation=conversation).aexists()
    assert not await Fiber.objects.filter(conversation=conversation).aexists()
