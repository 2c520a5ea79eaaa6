"""A regeneration whose worker is SIGKILLed mid-stream is recovered on its own branch: the first answer
stays set aside, whole, and comes back on a switch."""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.models import Branch
from chat.transcript.branches import BRANCH_KEY
from tests.support import ChatClient, assistant_text, chat_request, follow_conversation, numbers, user_message

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def stored(name: str) -> list[dict[str, Any]]:
    from chat.transcript.selectors import conversation_get, messages_list

    conversation = conversation_get(agent="assistant", name=name)
    assert conversation is not None
    return messages_list(conversation_id=conversation.pk)


async def test_a_regeneration_killed_mid_stream_finishes_on_its_branch(recovery_stack: Any) -> None:
    worker = recovery_stack.start_worker()
    name = f"branch-kill-{uuid.uuid4().hex[:8]}"
    question = user_message("count to 60 [rate 25]", f"u-{uuid.uuid4().hex[:8]}")
    try:
        async with ChatClient(recovery_stack.port, name) as client:
            await client.send(chat_request("r-first", [question]))
            await follow_conversation(client, timeout=30)
            first = await sync_to_async(stored)(name)

            await client.send(chat_request("r-regen", [question], trigger="regenerate-message"))
            log = await follow_conversation(
                client, until=lambda lg: len(lg.stream("r-regen").chunks) >= 15, timeout=30
            )
            worker.kill(signal.SIGKILL)
            await asyncio.to_thread(recovery_stack.start_worker)
            await follow_conversation(client, log, timeout=60)
            await asyncio.sleep(0.5)  # the transcript after the end frame
        assert log.text == numbers(60)
        messages = await sync_to_async(stored)(name)
        assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["id"] != first[1]["id"]
        assert assistant_text(messages) == numbers(60), "the recovered regeneration, whole, on its branch"
        [branch] = [b async for b in Branch.objects.filter(conversation__name=name)]
        assert branch.anchor_message_id == question["id"]
        assert [m["id"] for m in branch.messages] == [first[1]["id"]]
        assert assistant_text(branch.messages) == numbers(60), "the first answer set aside whole"
        last_seen = log.messages[-1]
        note = last_seen[1]["metadata"][BRANCH_KEY]
        assert note == {"anchorId": question["id"], "index": 1, "count": 2}
    finally:
        recovery_stack.stop_workers()
