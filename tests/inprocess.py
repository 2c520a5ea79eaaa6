"""A turn interrupted and recovered in the test process, through the real path: the turn stopped
mid-stream as a worker shutdown stops it, the tick's takeover of its lapsed lease, then (the caller's)
engine, alarm and continuation. Used with the `quiet_broker` fixture (tests/conftest.py), which records
what would reach the broker so the test runs it itself."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from django.db import transaction

from chat.transcript.turns import turn_start_programmatic
from chat.turn.runner import turn_run
from recovery.lease.fibers import fibers_take_expired
from recovery.models import Fiber, Stream
from recovery.process.runtime import db
from recovery.stream.buffer import stream_chunks


def take_expired() -> list[Any]:
    with transaction.atomic():
        return [fiber_id for fiber_id, _ in fibers_take_expired(10)]


async def take_released(timeout: float = 10.0) -> list[Any]:
    """take_expired, once the cancelled turn's lease is free: released as the cancellation unwinds, or,
    when the cancel came before the runner was far enough to hand its fiber over, lapsed after
    LEASE_TTL_S (the tick's takeover either way; the second was seen once with two test runners)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        taken = await db(take_expired)
        if taken or asyncio.get_running_loop().time() > deadline:
            return taken
        await asyncio.sleep(0.02)


async def stored_text(fiber_id: Any) -> str:
    stream = await Stream.objects.filter(fiber_id=fiber_id).afirst()
    chunks = [json.loads(body) for _, body in await db(stream_chunks, stream.pk)] if stream else []
    return "".join(c["delta"] for c in chunks if c["type"] == "text-delta")


async def interrupted_turn(agent: Any, prompt: str, *, until: str = "1 2 3") -> Fiber:
    """A turn stopped mid-answer by its worker's shutdown, its lapsed lease taken by the tick, once its
    stored text is `until` (the prompt must make the scripted model answer that, and more)."""
    started = await db(
        turn_start_programmatic, conversation_id=agent.conversation_id, messages=[prompt], enqueue=False
    )
    fiber = await Fiber.objects.aget(conversation_id=agent.conversation_id, request_id=started.request_id)
    running = asyncio.ensure_future(turn_run(str(fiber.pk)))
    deadline = time.monotonic() + 15
    while await stored_text(fiber.pk) != until:
        assert time.monotonic() < deadline, f"the turn stored {until!r}"
        await asyncio.sleep(0.05)
    running.cancel()  # the worker stops: the turn stores what it has and lets its lease lapse
    with pytest.raises(asyncio.CancelledError):
        await running
    assert await take_released() == [fiber.pk]
    return fiber


async def recovered_run(interrupted: Fiber, sent: dict[str, list[Any]]) -> Any:
    """Recover an interrupted turn in this process as the tick and a worker would: the engine decides,
    the alarm it scheduled fires, and the continuation it queued runs (`sent`: the quiet_broker fixture)."""
    from chat.turn.runner import turn_run
    from recovery.engine.alarms import afire_alarm
    from recovery.engine.spine import arecover_fiber

    await arecover_fiber(interrupted.pk)
    [alarm_id] = sent["alarms"]
    await afire_alarm(alarm_id)
    [continuation] = sent["turns"]
    return await turn_run(str(continuation))
