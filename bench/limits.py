"""Physical limits (P5) on this machine, for reading the other figures as a fraction of them.

- Postgres: batched inserts of segment-sized rows (10 chunks of ~60 bytes each), one INSERT per
  transaction, as the durable stream writes them, from one connection: rows/s and the chunks/s that is.
- Redis: channel-layer group_send of one batched frame message to a group with one member: messages/s.

    .venv/bin/python bench/limits.py --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid

from harness import progress, setup_django  # type: ignore[import-not-found]

CHUNK = '{"type":"text-delta","id":"t1","delta":" 123"}'


def postgres_rate(seconds: float) -> float:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMP TABLE bench_segment (id bigserial, stream uuid, seq int, body text)")
        stream, body, rows = str(uuid.uuid4()), "\n".join([CHUNK] * 10), 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            cursor.execute(
                "INSERT INTO bench_segment (stream, seq, body) VALUES (%s, %s, %s)", [stream, rows, body]
            )
            rows += 1
        cursor.execute("DROP TABLE bench_segment")
    return rows / seconds


async def redis_rate(seconds: float) -> float:
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    assert layer is not None
    group, channel = f"limits.{uuid.uuid4().hex[:8]}", await layer.new_channel()
    await layer.group_add(group, channel)
    frames = [[i, CHUNK] for i in range(10)]
    sent, deadline = 0, time.monotonic() + seconds

    async def drain() -> None:
        while True:
            await layer.receive(channel)

    reader = asyncio.create_task(drain())  # keep the channel under its capacity, as a consumer would
    while time.monotonic() < deadline:
        await layer.group_send(group, {"type": "think.frames", "request_id": "r", "frames": frames})
        sent += 1
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader  # its unsubscribe runs now, not as a task the loop's end cancels
    await layer.group_discard(group, channel)
    await layer.flush()  # the layer's connections close before the loop does
    return sent / seconds


def main(seconds: float) -> None:
    setup_django()
    progress("postgres batched inserts ...")
    pg = postgres_rate(seconds)
    progress("redis group_send ...")
    rd = asyncio.run(redis_rate(seconds))
    print(
        f"\npostgres: {pg:.0f} segment rows/s committed (autocommit, one connection) = {pg * 10:.0f} chunks/s"
    )
    print(f"redis channel layer: {rd:.0f} group_send/s of 10-frame batches = {rd * 10:.0f} frames/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5)
    main(parser.parse_args().seconds)
