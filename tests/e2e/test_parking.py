"""Pre-stream parking: a parked connection is released when no turn will stream."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.transcript.services import conversation_get_or_create
from recovery.models import Fiber
from tests.support import TEST_PRINCIPAL, ChatClient

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def accepted_turn(name: str) -> None:
    """A turn accepted but not started (no worker is told about it): the pre-stream window, held open."""
    conversation = conversation_get_or_create(agent="assistant", name=name, owner=TEST_PRINCIPAL)
    Fiber.objects.create(conversation=conversation, request_id="waiting-1")


async def test_a_parked_connection_is_released_when_the_waiting_turn_is_cancelled(stack: Any) -> None:
    name = f"park-{uuid.uuid4().hex[:8]}"
    await sync_to_async(accepted_turn)(name)
    async with ChatClient(stack.port, name) as watcher, ChatClient(stack.port, name) as sender:
        pending = await watcher.recv_type("cf_agent_stream_pending")
        assert pending["id"] == "waiting-1"
        await sender.recv_type("cf_agent_identity")
        await sender.send({"type": "cf_agent_chat_request_cancel", "id": "waiting-1"})
        done = await sender.recv_type("cf_agent_use_chat_response")
        assert done["done"] is True and done["outcome"] == "aborted"
        released = await watcher.recv_type("cf_agent_stream_resume_none")
        assert released == {"type": "cf_agent_stream_resume_none"}, "a bare release, not an idle answer"
    assert (await Fiber.objects.aget(request_id="waiting-1")).status == Fiber.Status.CANCELLED


async def test_a_parked_connection_is_released_by_a_clear(stack: Any) -> None:
    name = f"park-{uuid.uuid4().hex[:8]}"
    await sync_to_async(accepted_turn)(name)
    async with ChatClient(stack.port, name) as watcher, ChatClient(stack.port, name) as clearer:
        await watcher.recv_type("cf_agent_stream_pending")
        await clearer.recv_type("cf_agent_identity")
        await clearer.send({"type": "cf_agent_chat_clear"})
        assert await watcher.recv_type("cf_agent_chat_clear") == {"type": "cf_agent_chat_clear"}
        assert await watcher.recv_type("cf_agent_stream_resume_none") == {
            "type": "cf_agent_stream_resume_none"
        }
