"""Durability overhead (P1) and write amplification (P3), measured side by side in one run.

For one streamed turn of N chunks through the whole stack (litellm -> worker -> Postgres segments ->
channel layer -> daphne -> WebSocket client) it reports chunk throughput with persistence on (the
durable path) and off (THINK_STREAM_PERSIST=0: same path minus the segment writes), and the throughput
of a bare litellm stream read with nothing else. With persistence on it also counts the Postgres rows
inserted and transactions committed per 1,000 chunks.

    .venv/bin/python bench/throughput.py --chunks 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid

from harness import ROOT, log_dir, progress, scripted_model_process, setup_django  # type: ignore[import-not-found]


def turn_rows(name: str) -> int:
    """Rows one turn created: its conversation, messages, fiber, stream and segments."""
    from chat.models import Conversation, Message
    from recovery.models import Fiber, Segment, Stream

    conversation = Conversation.objects.get(name=name)
    return (
        1
        + Message.objects.filter(conversation=conversation).count()
        + Fiber.objects.filter(conversation=conversation).count()
        + Stream.objects.filter(conversation=conversation).count()
        + Segment.objects.filter(stream__conversation=conversation).count()
    )


def pg_counters() -> tuple[int, int]:
    """(transactions committed, rows inserted) in the benchmark database, all backends."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        commits = cursor.fetchone()[0]
        cursor.execute("SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables")
        inserts = cursor.fetchone()[0]
    return int(commits), int(inserts)


async def stack_turn(port: int, chunks: int, name: str | None = None) -> tuple[float, int]:
    """Seconds from the first chunk frame to the done frame, and the number of chunk frames.

    Throughput is counted in the model's chunks (`chunks`), not in frames: consecutive deltas taken in
    one flush reach the client as one frame (coalesced), more of them the faster the model is.
    """
    from tests.support import ChatClient, chat_request, user_message

    numbers = chunks - 6  # start, start-step, text-start ... text-end, finish-step, finish
    async with ChatClient(port, name or f"tp-{uuid.uuid4().hex[:8]}") as client:
        request_id = uuid.uuid4().hex[:10]
        await client.send(chat_request(request_id, [user_message(f"count to {numbers} [rate 0]")]))
        first, count = None, 0
        while True:
            frame = await client.recv(timeout=120)
            if frame.get("type") != "cf_agent_use_chat_response" or frame.get("id") != request_id:
                continue
            if frame.get("done"):
                return time.monotonic() - (first or time.monotonic()), count
            count += 1
            first = first or time.monotonic()


async def bare_litellm(model_url: str, chunks: int) -> tuple[float, int]:
    from chat.turn.llm import load_litellm

    litellm = load_litellm()
    response = await litellm.acompletion(
        model="openai/scripted",
        api_base=model_url,
        api_key="sk-scripted",
        stream=True,
        num_retries=0,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"count to {chunks - 7} [rate 0]"}],
    )
    first, count = None, 0
    async for _chunk in response:
        count += 1
        first = first or time.monotonic()
    return time.monotonic() - (first or time.monotonic()), count


async def measure(args: argparse.Namespace) -> None:
    setup_django()
    from tests.support import start_daphne, start_worker

    results: dict[str, list[float]] = {"durable": [], "persistence off": [], "bare litellm": []}
    rows_per_1000: list[float] = []
    commits_per_1000: list[float] = []
    frames_per_1000: list[float] = []
    with log_dir() as logs, scripted_model_process(logs, 0) as model_url:
        env = dict(os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=str(ROOT))
        daphne, port = start_daphne({**env, "DJANGO_CONN_MAX_AGE": "600"}, logs)
        workers = {
            "durable": start_worker(env, logs, name="tp-durable"),
            "persistence off": None,
        }
        try:
            await stack_turn(port, 50)  # warm-up (litellm import, connections)
            for n in range(1, args.rounds + 1):
                # Backends report statistics when idle for a while: settle before and after.
                await asyncio.sleep(args.settle)
                before = await asyncio.to_thread(pg_counters)
                name = f"tp-{uuid.uuid4().hex[:8]}"
                elapsed, frames = await stack_turn(port, args.chunks, name)
                await asyncio.sleep(args.settle)
                after = await asyncio.to_thread(pg_counters)
                results["durable"].append(args.chunks / elapsed)
                frames_per_1000.append(frames * 1000 / args.chunks)
                rows_per_1000.append(await asyncio.to_thread(turn_rows, name) * 1000 / args.chunks)
                commits_per_1000.append((after[0] - before[0]) * 1000 / args.chunks)
                elapsed, count = await bare_litellm(model_url, args.chunks)
                results["bare litellm"].append(count / elapsed)
                progress(f"round {n}/{args.rounds}: durable {results['durable'][-1]:.0f} chunks/s")
            workers["durable"].stop()  # type: ignore[union-attr]
            workers["persistence off"] = start_worker(
                dict(env, THINK_STREAM_PERSIST="0"), logs, name="tp-nopersist"
            )
            await stack_turn(port, 50)
            for n in range(1, args.rounds + 1):
                elapsed, frames = await stack_turn(port, args.chunks)
                results["persistence off"].append(args.chunks / elapsed)
                progress(
                    f"round {n}/{args.rounds}: persistence off {results['persistence off'][-1]:.0f} chunks/s"
                )
        finally:
            for proc in [daphne, *[w for w in workers.values() if w is not None]]:
                proc.stop()
    report(results, rows_per_1000, commits_per_1000, args.chunks)
    frames = statistics.median(frames_per_1000)
    print(f"  frames per 1,000 chunks at the client (coalesced deltas): {frames:.1f}")


def report(results: dict[str, list[float]], rows: list[float], commits: list[float], chunks: int) -> None:
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nchunk throughput, {chunks}-chunk turns, median of {len(results['durable'])} (chunks/s):")
    for name, value in med.items():
        print(f"  {name:16} {value:9.0f}")
    print(f"  durable / persistence off = {med['durable'] / med['persistence off']:.2f}x (target >= 0.90x)")
    print(f"  durable / bare litellm    = {med['durable'] / med['bare litellm']:.2f}x")
    print("write amplification with persistence on:")
    print(f"  rows per 1,000 chunks (the turn's own rows): {statistics.median(rows):.1f} (target <= 100)")
    print(f"  transactions per 1,000 chunks (whole database): {statistics.median(commits):.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settle", type=float, default=11, help="seconds for Postgres statistics to settle")
    asyncio.run(measure(parser.parse_args()))
