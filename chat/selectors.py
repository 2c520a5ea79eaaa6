"""Reads: transcripts, active streams and turns."""

from __future__ import annotations

from typing import Any

from recovery.models import Fiber, Stream

from .models import Conversation, Message


def conversation_get(*, agent: str, name: str) -> Conversation | None:
    return Conversation.objects.filter(agent=agent, name=name).first()


def messages_list(*, conversation_id: int) -> list[dict[str, Any]]:
    """The transcript as UIMessages, in order."""
    rows = Message.objects.filter(conversation_id=conversation_id).order_by("position")
    return [m.as_ui_message() for m in rows]


def active_stream(*, conversation_id: int) -> Stream | None:
    """The newest stream still marked streaming (live, or orphaned until recovery settles it)."""
    return (
        Stream.objects.filter(conversation_id=conversation_id, status=Stream.Status.STREAMING)
        .order_by("-created_at")
        .first()
    )


def stream_for_request(*, conversation_id: int, request_id: str) -> Stream | None:
    return (
        Stream.objects.filter(conversation_id=conversation_id, request_id=request_id)
        .order_by("-created_at")
        .first()
    )


def pending_turn_request_id(*, conversation_id: int) -> str | None:
    """The newest accepted turn that has not started streaming yet (the pre-stream window)."""
    fibers = Fiber.objects.filter(conversation_id=conversation_id).active().order_by("-created_at")
    for fiber in fibers:
        if not Stream.objects.filter(fiber=fiber).exists():
            return fiber.request_id
    return None
