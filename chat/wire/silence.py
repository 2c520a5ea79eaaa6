"""Silence on a live stream: a connection that follows one and hears nothing fills it from Postgres.

Every frame of a stream is stored before it is published, and the channel layer may still lose one:
Redis drops what overflows a channel, a web process restarts its subscription, a publish fails while
the worker carries on. A gap before a later frame is filled when that frame arrives
(`ChatConsumer._send_in_order`); a lost tail has no later frame to show it. So each connection keeps,
per stream it follows live, when it last heard of it, and one task per web event loop looks at every
connection's streams: one quiet for `STREAM_SILENCE_MS` reads the store, sends the chunks it holds
past the last one sent and, once the store says the stream ended, its end frame and the transcript,
as a late ACK would have. A stream that is quiet in the store too (a model that stalls) is looked at
again after twice the wait, up to `SILENCE_MAX_WAIT_S`, so a long stall costs a few reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Protocol

from ..conf import think_setting

logger = logging.getLogger(__name__)

SILENCE_MAX_WAIT_S = 30.0


class Listener(Protocol):
    async def look_for_silence(self, now: float) -> None: ...


class _Watch:
    """The connections of one event loop that follow a stream, looked at a few times per wait."""

    def __init__(self) -> None:
        self.listeners: weakref.WeakSet[Listener] = weakref.WeakSet()
        self.task: asyncio.Task[None] | None = None

    def add(self, listener: Listener) -> None:
        self.listeners.add(listener)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name="think-silence-watch")

    async def _run(self) -> None:
        while self.listeners:
            await asyncio.sleep(silence_wait() / 4)
            now = time.monotonic()
            for listener in list(self.listeners):
                try:
                    await listener.look_for_silence(now)
                except Exception:  # one connection's failure must not blind the others
                    logger.exception("looking for silence on a connection failed")


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watch] = weakref.WeakKeyDictionary()


def silence_wait() -> float:
    """Seconds without a frame after which a followed stream is looked up in the store."""
    return float(think_setting("STREAM_SILENCE_MS")) / 1000


def watch(listener: Listener) -> None:
    """Look at `listener` from now on (it says itself which of its streams are quiet)."""
    loop = asyncio.get_running_loop()
    found = _watches.get(loop)
    if found is None:
        found = _watches[loop] = _Watch()
    found.add(listener)


def unwatch(listener: Listener) -> None:
    found = _watches.get(asyncio.get_running_loop())
    if found is not None:
        found.listeners.discard(listener)
