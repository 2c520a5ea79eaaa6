"""Concurrency (P4): concurrent streaming turns on one host, and their model-to-client chunk latency.

For each level L, L WebSocket clients each start a turn at the same time ("count to N [rate R] [stamp]":
the scripted model stamps every delta with its send time), and the latency of every chunk is measured
at the client: receive time minus send time. Everything runs on this machine (2 cores): Postgres, Redis,
daphne, the worker(s), the scripted model and this client.

    .venv/bin/python bench/concurrency.py --levels 25 50 100 200 --workers 1 --threads 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid

from harness import ROOT, log_dir, percentile, progress, scripted_model_process, setup_django  # type: ignore[import-not-found]


async def one_turn(port: int, numbers: int, rate: float, latencies: list[float]) -> bool:
    from tests.support import ChatClient, chat_request, user_message

    async with ChatClient(port, f"cc-{uuid.uuid4().hex[:8]}") as client:
        request_id = uuid.uuid4().hex[:10]
        prompt = f"count to {numbers} [rate {rate}] [stamp]"
        await client.send(chat_request(request_id, [user_message(prompt)]))
        while True:
            raw = await asyncio.wait_for(client.ws.recv(), 120)
            now = time.time()
            frame = json.loads(raw)
            if frame.get("type") != "cf_agent_use_chat_response" or frame.get("id") != request_id:
                continue
            if frame.get("done"):
                return frame.get("outcome") == "completed"
            chunk = json.loads(frame["body"]) if frame.get("body") else {}
            if chunk.get("type") == "text-delta" and "@" in chunk.get("delta", ""):
                latencies.append(now - float(chunk["delta"].rsplit("@", 1)[1]))


async def level(port: int, turns: int, numbers: int, rate: float) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    started = time.monotonic()
    results = await asyncio.gather(
        *(one_turn(port, numbers, rate, latencies) for _ in range(turns)), return_exceptions=True
    )
    completed = sum(1 for r in results if r is True)
    for failure in {repr(r) for r in results if isinstance(r, BaseException)}:
        progress(f"  a turn failed at the client: {failure}")
    return latencies, completed, time.monotonic() - started


async def main(args: argparse.Namespace) -> None:
    setup_django()
    from tests.support import start_daphne, start_worker

    rows = []
    with log_dir() as logs, scripted_model_process(logs, args.rate) as model_url:
        env = dict(os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=str(ROOT))
        daphne, port = start_daphne(env, logs)
        workers = []
        try:
            for _ in range(args.workers):
                workers.append(start_worker(env, logs, name="cc-worker", concurrency=args.threads))
            await level(port, 2, 10, args.rate)  # warm-up
            for turns in args.levels:
                latencies, completed, elapsed = await level(port, turns, args.numbers, args.rate)
                p50, p99 = percentile(latencies, 50) * 1000, percentile(latencies, 99) * 1000
                rows.append((turns, completed, len(latencies), p50, p99, elapsed))
                progress(
                    f"{turns} turns: {completed} done, p50 {p50:.0f} ms, p99 {p99:.0f} ms, {elapsed:.1f} s"
                )
        finally:
            for proc in [daphne, *workers]:
                proc.stop()
    print(
        f"\n{args.workers} worker process(es) x {args.threads} threads, {args.numbers} chunks/turn at "
        f"{args.rate} tokens/s"
    )
    print("turns  completed  chunks   p50 ms   p99 ms   wall s")
    for turns, completed, chunks, p50, p99, elapsed in rows:
        print(f"{turns:5}  {completed:9}  {chunks:6}  {p50:7.0f}  {p99:7.0f}  {elapsed:7.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=256)
    parser.add_argument("--numbers", type=int, default=100)
    parser.add_argument("--rate", type=float, default=20)
    asyncio.run(main(parser.parse_args()))
