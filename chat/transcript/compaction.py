"""Compaction's stored half: a summary overlay over a span of the transcript.

A compaction's result (chat.turn.session, which calls the model) is stored here as an overlay: the
summarised messages stay in Postgres, and every read of the transcript (the model's, the clients') shows
the summary in their place.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from django.db import transaction

from ..models import Compaction, Conversation, Message
from ..types import UIMessage

logger = logging.getLogger(__name__)

COMPACTION_PREFIX = "compaction_"
TokenCounter = Callable[[UIMessage], int]


@dataclass(frozen=True)
class CompactionResult:
    """Replace the messages from `from_message_id` to `to_message_id` (inclusive) with `summary`."""

    from_message_id: str
    to_message_id: str
    summary: str


def estimate_tokens(message: UIMessage) -> int:
    """About four characters per token, over everything the model would read of the message."""
    return math.ceil(len(json.dumps(message.get("parts") or [], ensure_ascii=False)) / 4) + 4


def real_message_id(conversation_id: int, message_id: str, end: str) -> str | None:
    """A message id of the raw transcript; a summary's id stands for the edge of the range it covers."""
    if message_id.startswith(COMPACTION_PREFIX):
        overlay = Compaction.objects.filter(
            conversation_id=conversation_id, compaction_id=message_id[len(COMPACTION_PREFIX) :]
        ).first()
        if overlay is None:
            return None
        return overlay.from_message_id if end == "from" else overlay.to_message_id
    exists = Message.objects.filter(conversation_id=conversation_id, message_id=message_id).exists()
    return message_id if exists else None


def compaction_store(*, conversation_id: int, result: CompactionResult) -> Compaction | None:
    """Store an overlay; overlays it covers (or extends) are replaced by it. None if the range is unknown."""
    with transaction.atomic():
        Conversation.objects.select_for_update().get(pk=conversation_id)
        start = real_message_id(conversation_id, result.from_message_id, "from")
        end = real_message_id(conversation_id, result.to_message_id, "to")
        if start is None or end is None:
            return None
        positions = dict(
            Message.objects.filter(conversation_id=conversation_id, message_id__in=[start, end]).values_list(
                "message_id", "position"
            )
        )
        low, high = positions[start], positions[end]
        if low > high:
            return None
        for overlay in Compaction.objects.filter(conversation_id=conversation_id):
            edges = Message.objects.filter(
                conversation_id=conversation_id,
                message_id__in=[overlay.from_message_id, overlay.to_message_id],
            ).values_list("position", flat=True)
            if edges and low <= min(edges) and max(edges) <= high:
                overlay.delete()
        return Compaction.objects.create(
            conversation_id=conversation_id,
            compaction_id=uuid.uuid4().hex,
            from_message_id=start,
            to_message_id=end,
            summary=result.summary,
        )


def render_transcript(messages: list[UIMessage]) -> str:
    """One line per message, as the summariser reads it."""
    lines = []
    for message in messages:
        pieces = []
        for part in message.get("parts") or []:
            if part.get("type") in ("text", "reasoning") and part.get("text"):
                pieces.append(str(part["text"]))
            elif str(part.get("type", "")).startswith("tool-") or part.get("type") == "dynamic-tool":
                name = part.get("toolName") or str(part.get("type"))[len("tool-") :]
                result = part.get("output", part.get("errorText"))
                pieces.append(f"[tool {name}({json.dumps(part.get('input'))}) -> {json.dumps(result)}]")
        text = " ".join(pieces).replace("\n", " ").strip()
        if text:
            lines.append(f"{message.get('role', 'user')}: {text}")
    return "\n".join(lines)


def tail_start(
    messages: list[UIMessage], count: TokenCounter, protect_head: int, budget: int, minimum: int
) -> int:
    start, used = len(messages), 0
    while start > protect_head:
        cost = count(messages[start - 1])
        if len(messages) - start >= minimum and used + cost > budget:
            break
        used += cost
        start -= 1
    while protect_head < start < len(messages) and messages[start].get("role") != "user":
        start -= 1  # begin the tail at a user message
    return start
