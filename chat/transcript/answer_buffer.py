"""Answers that arrive while their turn still runs: the buffer (`Conversation.tool_updates`) the turn
applies when it stores its message (chat.transcript.interactions), and its bounds.

The buffer is one JSON column, rewritten under the conversation's lock with each answer, so what a
client may put there is bounded: an answer is buffered only for a tool call the running turn has
streamed (a `tool-input-*` chunk with its id, stored before any client saw it), at most
THINK["MAX_BUFFERED_TOOL_UPDATES"] of them, at most THINK["MAX_BUFFERED_TOOL_UPDATE_BYTES"] together.
"""

from __future__ import annotations

import json
from typing import Any

from recovery.models import Fiber, Segment

from ..conf import think_setting
from ..models import Conversation
from ..protocol import json_size

IN_FLIGHT = (Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED)  # their message is not stored yet


def turn_in_flight(conversation: Conversation) -> bool:
    """A turn of the conversation runs (or was interrupted) and has not stored its message yet."""
    return Fiber.objects.filter(conversation=conversation, status__in=IN_FLIGHT).exists()


def streamed_tool_call(conversation_id: int, tool_call_id: str) -> bool:
    """Whether a turn in flight streamed a call with this id. Chunks are stored before they are sent
    (recovery.stream.flusher), so a call a client was shown is found here."""
    needle = '"toolCallId":' + json.dumps(tool_call_id, ensure_ascii=False)
    segments = Segment.objects.filter(
        stream__conversation_id=conversation_id, stream__fiber__status__in=IN_FLIGHT, body__contains=needle
    )
    for body in segments.values_list("body", flat=True).iterator():
        for line in body.split("\n"):
            if needle not in line:
                continue
            chunk = json.loads(line)
            if (
                str(chunk.get("type", "")).startswith("tool-input-")
                and chunk.get("toolCallId") == tool_call_id
            ):
                return True
    return False


def buffer_refusal(conversation: Conversation, update: dict[str, Any]) -> str:
    """Why `update` may not wait in the buffer ("" when it may). Call with the conversation locked."""
    tool_call_id = str(update["toolCallId"])
    if not streamed_tool_call(conversation.pk, tool_call_id):
        return f"no turn of this conversation called tool call {tool_call_id!r}"
    waiting = list(conversation.tool_updates)
    most = think_setting("MAX_BUFFERED_TOOL_UPDATES")
    if len(waiting) >= most:
        return f"{most} answers already wait for the running turn; send it when the turn has ended"
    budget = think_setting("MAX_BUFFERED_TOOL_UPDATE_BYTES")
    if json_size([*waiting, buffered_copy(update)]) > budget:
        return (
            f"the answers waiting for the running turn would be larger than {budget} bytes; send it when"
            " the turn has ended"
        )
    return ""


def buffered_copy(update: dict[str, Any]) -> dict[str, Any]:
    """What the buffer keeps of an answer: its `clientTools` are the conversation's already."""
    return {key: value for key, value in update.items() if key != "clientTools"}


def already_buffered(conversation: Conversation, update: dict[str, Any]) -> bool:
    """The same kind of answer for this call waits already: the first one wins when it is applied."""
    return any(
        waiting.get("toolCallId") == update["toolCallId"] and waiting.get("kind") == update["kind"]
        for waiting in conversation.tool_updates
    )
