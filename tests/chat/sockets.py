"""The chat consumer in-process: a WebsocketCommunicator on the real channel layer and database.

Routed like thinkproject/asgi.py routes /agents/<agent>/<name> (the origin check and the session
middleware left out: they need a browser and a host), so no daphne and no worker is needed. Tests that
use it must never get a chat request accepted: that would enqueue a turn for a worker.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from channels.db import database_sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from chat.models import Conversation, Message
from chat.routing import websocket_urlpatterns
from recovery.models import Fiber
from tests.support import TEST_PRINCIPAL, access_token

APPLICATION = URLRouter(websocket_urlpatterns)  # type: ignore[arg-type]
TIMEOUT_S = 10

Frame = dict[str, Any]


def new_name(prefix: str = "inproc") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@asynccontextmanager
async def connected(name: str, agent: str = "assistant") -> AsyncIterator[WebsocketCommunicator]:
    """An open socket on the conversation, past its connect frames (up to cf_agent_identity)."""
    communicator = WebsocketCommunicator(APPLICATION, f"/agents/{agent}/{name}?token={access_token()}")
    accepted, _ = await communicator.connect(timeout=TIMEOUT_S)
    assert accepted
    await receive_until(communicator, lambda frame: frame["type"] == "cf_agent_identity")
    try:
        yield communicator
    finally:
        await communicator.disconnect(timeout=TIMEOUT_S)


async def receive_until(
    communicator: WebsocketCommunicator, done: Callable[[Frame], bool], timeout: float = TIMEOUT_S
) -> list[Frame]:
    """Every frame sent to the client up to and including the first one `done` accepts.

    A crashed consumer raises its exception here; a closed socket fails the test.
    """
    frames: list[Frame] = []
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        remaining = max(deadline - asyncio.get_running_loop().time(), 0.01)
        message = await communicator.receive_output(timeout=remaining)
        assert message["type"] == "websocket.send", f"the socket was closed: {message}"
        frame = json.loads(message["text"])
        frames.append(frame)
        if done(frame):
            return frames


async def probe(communicator: WebsocketCommunicator, probe_id: str = "probe") -> tuple[Frame, list[Frame]]:
    """Send a resume probe; its answer, and the frames that came before it."""
    await communicator.send_to(
        text_data=json.dumps({"type": "cf_agent_stream_resume_request", "probeId": probe_id})
    )
    frames = await receive_until(communicator, lambda frame: frame.get("probeId") == probe_id)
    return frames[-1], frames[:-1]


async def chat_response(communicator: WebsocketCommunicator, request_id: str) -> Frame:
    """The next cf_agent_use_chat_response frame for `request_id`."""
    frames = await receive_until(
        communicator,
        lambda frame: frame["type"] == "cf_agent_use_chat_response" and frame.get("id") == request_id,
    )
    return frames[-1]


@database_sync_to_async
def seed_conversation(name: str, messages: list[Frame], agent: str = "assistant") -> int:
    conversation = Conversation.objects.create(agent=agent, name=name, owner=TEST_PRINCIPAL)
    for position, message in enumerate(messages):
        Message.objects.create(
            conversation=conversation,
            message_id=message["id"],
            role=message["role"],
            parts=message.get("parts", []),
            metadata=message.get("metadata"),
            position=position,
        )
    return conversation.pk


@database_sync_to_async
def stored_state(conversation_id: int) -> dict[str, Any]:
    """Everything a refused frame must leave alone: the transcript, the request context, the fibers."""
    conversation = Conversation.objects.get(pk=conversation_id)
    return {
        "messages": list(
            Message.objects.filter(conversation_id=conversation_id)
            .order_by("position")
            .values_list("message_id", "role", "parts", "metadata", "position", "updated_at")
        ),
        "conversation": [
            conversation.last_body,
            conversation.last_client_tools,
            conversation.last_terminal,
            conversation.tool_updates,
            conversation.continue_armed,
        ],
        "fibers": list(
            Fiber.objects.filter(conversation_id=conversation_id).values_list("request_id", "status")
        ),
    }
