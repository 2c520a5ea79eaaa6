"""Limits on client input, from the THINK settings: frame sizes (checked by the codec), the messages and
queue depth a chat request may add (checked when its turn is accepted), and each connection's frame rate.

A frame refused for any of them changes nothing stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from recovery.models import Fiber, FiberQuerySet

from ..conf import think_setting
from ..exceptions import ProtocolError
from ..models import Message
from ..transcript.compaction import COMPACTION_PREFIX
from .protocol import ChatRequest, Limits, check_message_limits


def frame_limits() -> Limits:
    """The size limits the codec and turn acceptance check, from the THINK settings."""
    return Limits(
        max_frame_bytes=think_setting("MAX_FRAME_BYTES"),
        max_message_bytes=think_setting("MAX_MESSAGE_BYTES"),
        max_message_parts=think_setting("MAX_MESSAGE_PARTS"),
        max_tool_output_bytes=think_setting("MAX_TOOL_OUTPUT_BYTES"),
    )


def turn_refusal(*, conversation_id: int, request: ChatRequest, busy: FiberQuerySet, policy: str) -> str:
    """Why a chat request is refused ("" when it is not): a message it adds is over the limits, or the
    conversation's queue is full. Messages the server already has are echoes and not checked: the
    server wrote them itself (long answers, big tool outputs). Call with the conversation locked."""
    known = set(Message.objects.filter(conversation_id=conversation_id).values_list("message_id", flat=True))
    limits = frame_limits()
    for message in request.messages:
        if message["id"] in known or message["id"].startswith(COMPACTION_PREFIX):
            continue
        try:
            check_message_limits(message, limits)
        except ProtocolError as exc:
            return str(exc)
    queued = think_setting("MAX_QUEUED_TURNS")
    if policy == "queue" and busy.filter(status=Fiber.Status.PENDING).count() >= queued:
        return f"{queued} turns are already queued in this conversation; send it when one has run"
    return ""


class TokenBucket:
    """`burst` frames at once, then `rate` a second: each frame takes a token, tokens refill over time."""

    def __init__(self, *, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = float(burst)
        self.updated = clock()

    def take(self) -> bool:
        """Take a token for one frame; False (and nothing taken) when the bucket is empty."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def frame_bucket(*, clock: Callable[[], float] = time.monotonic) -> TokenBucket:
    """A connection's bucket, from THINK["MAX_FRAMES_PER_S"] and THINK["MAX_FRAME_BURST"]."""
    rate, burst = think_setting("MAX_FRAMES_PER_S"), think_setting("MAX_FRAME_BURST")
    return TokenBucket(rate=float(rate), burst=int(burst), clock=clock)
