"""Limits on client input, from the THINK settings: frame sizes (chat.conf.frame_limits, checked by the
codec), the messages and queue depth a chat request may add (checked when its turn is accepted,
chat.transcript.turns.turn_refusal), and each connection's frame rate (here).

A frame refused for any of them changes nothing stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..conf import think_setting


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
