"""The last check before a frame leaves: nothing over the WebSocket server's message limit is sent.

daphne (autobahn underneath) refuses to send a WebSocket message over 1 MiB and closes the socket with
1011, so one oversized frame would end the connection, and every reconnect that replays it would end
the same way. The sources are bounded where they can be (transcripts are windows, chat.transcript.window;
delta chunks are cut in pieces, chat.turn.chunking.coalesce), which leaves what a single chunk or
message carries whole: a tool's output or input, an agent's data part, a long error text, a message
updated with such a part. Such a frame is sent smaller instead:

- a stream chunk (`cf_agent_use_chat_response`) keeps its request, seq and flags, and its body becomes
  a transient `data-think-omitted` part saying how large the chunk was; the stored stream and message
  keep it whole, and the transcript the client gets when the turn ends shows the message (cut for
  display if it is itself too large);
- a frame that carries messages (`cf_agent_chat_messages`, `cf_agent_message_updated`) carries them
  cut for display, as the transcript window does (`metadata.thinkTruncated`).

The check costs one length comparison for a frame of under a quarter of the limit in characters.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .. import protocol as p
from ..transcript.window import message_bytes, truncated_for_display
from ..types import UIMessage

logger = logging.getLogger(__name__)

# autobahn's default maxMessagePayloadSize, which daphne keeps: the largest message it sends
# (THINK["MAX_SEND_BYTES"], for a server whose limit is another).
SEND_LIMIT_BYTES = 1_048_576
FRAME_ROOM_BYTES = 4_096  # kept for a frame's envelope around what it carries


def fits(text: str, limit: int = SEND_LIMIT_BYTES) -> bool:
    """Whether `text` goes out as one WebSocket message (UTF-8 is at most 4 bytes a character)."""
    return len(text) * 4 <= limit or len(text.encode()) <= limit


def fit_frame(text: str, limit: int = SEND_LIMIT_BYTES) -> str:
    """`text`, a frame over `limit` bytes, made to fit as the module says (unchanged if it fits)."""
    if fits(text, limit):
        return text
    frame: dict[str, Any] = json.loads(text)
    size = len(text.encode())
    kind = frame.get("type")
    logger.warning("a %s frame of %d bytes is over the send limit (%d): sent smaller", kind, size, limit)
    if kind == p.USE_CHAT_RESPONSE:
        omitted = {
            "type": "data-think-omitted",
            "data": {"reason": "too_large", "bytes": size},
            "transient": True,
        }
        return p.dumps({**frame, "body": p.dumps(omitted)})
    if kind == p.MESSAGE_UPDATED:
        return p.dumps(
            {**frame, "message": truncated_for_display(frame["message"], limit - FRAME_ROOM_BYTES)}
        )
    if kind == p.CHAT_MESSAGES:
        messages: list[UIMessage] = frame.get("messages") or []
        share = (limit - FRAME_ROOM_BYTES) // max(1, len(messages))
        cut = [truncated_for_display(m, share) if message_bytes(m) > share else m for m in messages]
        return p.dumps({**frame, "messages": cut})
    raise ValueError(f"a {kind} frame of {size} bytes is over the WebSocket send limit ({limit})")
