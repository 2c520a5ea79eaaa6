"""Conversations of any length (issue 21, item 7): what a turn and a connect cost as the history grows.

For each history length (stored messages of about 190 bytes of JSON each, inserted directly), on a real
daphne and one Celery worker (threads) with the scripted model unpaced:

- connect: a client opens the socket and reads the transcript frame and the identity, then closes;
  daphne's CPU per connect (its process tree, bench/procstat.py), and the transcript frame's size. A
  connect that daphne ends with 1011 (a transcript frame over its 1 MiB limit) is counted as such.
- turn: a client sends a chat request echoing the transcript it was sent on connect (as the published
  hook does) plus `count to 5`, and follows the stream to its end; the worker's and daphne's CPU per
  turn, measured from outside (their process trees), and the wall time per turn.

    .venv/bin/python bench/history.py --sizes 100 1000 3000 8000 --turns 5 --connects 10

It uses its own database (thinkproject_bench_history) and Redis databases 4, 5, 6 unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from typing import Any

os.environ.setdefault("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/thinkproject_bench_history")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/4")
os.environ.setdefault("CHANNELS_REDIS_URL", "redis://127.0.0.1:6379/5")
os.environ.setdefault("CACHE_REDIS_URL", "redis://127.0.0.1:6379/6")

from harness import ROOT, log_dir, progress, scripted_model_process, setup_django  # type: ignore[import-not-found]  # noqa: E402
from procstat import cpu_seconds, tree_pids  # type: ignore[import-not-found]  # noqa: E402

FILLER = "The customer asked about the order and the assistant explained the schedule. "


def grow(name: str, count: int) -> None:
    from chat.agents import open_agent
    from chat.models import Message
    from tests.support import TEST_PRINCIPAL

    conversation_id = open_agent("assistant", name, owner=TEST_PRINCIPAL).conversation_id
    Message.objects.bulk_create(
        (
            Message(
                conversation_id=conversation_id,
                message_id=f"h{i}",
                role="user" if i % 2 == 0 else "assistant",
                parts=[{"type": "text", "text": f"m{i}: {FILLER}"}],
                position=i,
            )
            for i in range(count)
        ),
        batch_size=2000,
    )


def tree_cpu(pid: int) -> float:
    return cpu_seconds(tree_pids(pid))


async def connect_once(port: int, name: str) -> tuple[list[dict[str, Any]] | None, int, int | None]:
    """The transcript a connect gets, its frame's size, and the close code if daphne closed instead."""
    import websockets

    from tests.support import ChatClient

    async with ChatClient(port, name) as client:
        try:
            raw = await asyncio.wait_for(client.ws.recv(), 30)
            frame = json.loads(raw)
            await client.recv_type("cf_agent_identity")
        except websockets.ConnectionClosed as closed:
            return None, 0, closed.rcvd.code if closed.rcvd else None
        return frame.get("messages"), len(raw.encode()), None


def busy(name: str) -> bool:
    from recovery.models import Fiber

    return Fiber.objects.filter(conversation__name=name).active().exists()


async def one_turn(port: int, name: str) -> tuple[float, bool]:
    """Wall time of a turn, and whether its client saw it end (False: daphne closed the socket; the turn
    is then waited for in the database)."""
    import websockets
    from asgiref.sync import sync_to_async

    from tests.support import ChatClient, chat_request, user_message

    started = time.monotonic()
    messages, _, _ = await connect_once(port, name)
    async with ChatClient(port, name) as client:
        request_id = uuid.uuid4().hex[:10]
        await client.send(chat_request(request_id, [*(messages or []), user_message("count to 5")]))
        try:
            log = await client.follow(request_id, timeout=120)
        except websockets.ConnectionClosed:
            await asyncio.sleep(0.2)
            while await sync_to_async(busy)(name):
                await asyncio.sleep(0.05)
            return time.monotonic() - started, False
        if log.errors or log.done is None:
            raise RuntimeError(f"turn failed: {log.errors}")
    return time.monotonic() - started, True


async def measure(
    size: int, port: int, daphne: int, worker: int, turns: int, connects: int
) -> dict[str, Any]:
    from asgiref.sync import sync_to_async

    name = f"bench-history-{size}-{uuid.uuid4().hex[:6]}"
    await sync_to_async(grow)(name, size)
    await connect_once(port, name)  # warm: the first read of the conversation
    before = tree_cpu(daphne)
    codes, frame_bytes = [], 0
    for _ in range(connects):
        _, frame_bytes, code = await connect_once(port, name)
        codes.append(code)
    connect_ms = (tree_cpu(daphne) - before) / connects * 1000
    await one_turn(port, name)  # warm
    worker_before, daphne_before = tree_cpu(worker), tree_cpu(daphne)
    results = [await one_turn(port, name) for _ in range(turns)]
    walls = [wall for wall, _ in results]
    return {
        "size": size,
        "connect_ms": connect_ms,
        "frame_bytes": frame_bytes,
        "closed": sum(1 for c in codes if c is not None),
        "close_code": next((c for c in codes if c is not None), None),
        "worker_ms": (tree_cpu(worker) - worker_before) / turns * 1000,
        "daphne_ms": (tree_cpu(daphne) - daphne_before) / turns * 1000,
        "wall_ms": sum(walls) / turns * 1000,
        "turns_cut": sum(1 for _, seen in results if not seen),
    }


async def main(sizes: list[int], turns: int, connects: int) -> None:
    from tests.support import start_daphne, start_worker

    setup_django()
    with log_dir() as logs, scripted_model_process(logs, 0) as model_url:
        env = dict(
            os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=os.environ.get("PYTHONPATH", str(ROOT))
        )
        daphne, port = start_daphne({**env, "DJANGO_CONN_MAX_AGE": "600"}, logs)
        worker = start_worker(env, logs, name="bench-history-worker")
        try:
            assert daphne.popen is not None and worker.popen is not None
            rows = []
            for size in sizes:
                row = await measure(size, port, daphne.popen.pid, worker.popen.pid, turns, connects)
                rows.append(row)
                progress(f"{size} messages: {row}")
        finally:
            worker.stop()
            daphne.stop()
    print(
        "\nmessages | connect: daphne CPU ms, frame bytes, closed (code)"
        " | turn: worker CPU ms, daphne CPU ms, wall ms, sockets closed before the end"
    )
    for r in rows:
        closed = f"{r['closed']}/{connects} ({r['close_code']})" if r["closed"] else "0"
        print(
            f"{r['size']:>8} | {r['connect_ms']:7.1f} {r['frame_bytes']:>9} {closed:>10} |"
            f" {r['worker_ms']:7.1f} {r['daphne_ms']:7.1f} {r['wall_ms']:7.1f} {r['turns_cut']}/{turns}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 3000, 8000])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--connects", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.sizes, args.turns, args.connects))
