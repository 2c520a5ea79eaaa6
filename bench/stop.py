"""Stop (S1): what a cancel costs and what it lets through.

Each round streams `count to 400` at 20 chunks/s with `[stamp]` (the scripted model appends its send
time to every delta), lets the client receive 20 numbers, then sends cancel_request. It counts:

- chunks stored after the cancel: stored deltas whose model send time is later than the moment the
  client sent the cancel (the goal is 0: nothing the model produced after the cancel arrived is kept);
- chunk frames that reached the client after it sent the cancel (stored before the cancel committed,
  so in the answer, but still on the way: the published hook drops them once stop() is called, and the
  transcript that follows the end frame puts them on its screen);
- cancel -> done: from sending the cancel to receiving the turn's end frame (the turn has stopped its
  model call, stored its answer and told its clients by then).

Run once with the worker's cancel signal (the default) and once without it (THINK['CANCEL_SIGNALS']
off, as behind a pooler in transaction mode: the flag is then seen at the next flush or heartbeat).

    .venv/bin/python bench/stop.py --rounds 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from typing import Any

from harness import ROOT, log_dir, progress, scripted_model_process, setup_django, summary  # type: ignore[import-not-found]

PROMPT = "count to 400 [rate 20] [stamp]"
RECEIVED_BEFORE_CANCEL = 20


def stamp_of(delta: str) -> float | None:
    """The model's send time carried by a [stamp]ed delta (" 17@1764633600.123")."""
    _, _, stamp = delta.rpartition("@")
    try:
        return float(stamp)
    except ValueError:
        return None


def stored_deltas(request_id: str) -> list[tuple[int, str]]:
    import json

    from recovery.models import Stream
    from recovery.stream.buffer import stream_chunks

    stream = Stream.objects.get(request_id=request_id)
    deltas = []
    for seq, body in stream_chunks(stream.pk):
        chunk = json.loads(body)
        if chunk.get("type") == "text-delta":
            deltas.append((seq, chunk["delta"]))
    return deltas


async def one_round(port: int) -> dict[str, Any]:
    from asgiref.sync import sync_to_async

    from tests.support import ChatClient, chat_request, user_message

    name = f"bench-stop-{uuid.uuid4().hex[:8]}"
    request_id = uuid.uuid4().hex[:10]
    async with ChatClient(port, name) as client:
        await client.send(chat_request(request_id, [user_message(PROMPT)]))
        received: list[int] = []
        while len(received) < RECEIVED_BEFORE_CANCEL:
            frame = await client.recv(30)
            if frame.get("type") == "cf_agent_use_chat_response" and '"text-delta"' in frame.get("body", ""):
                received.append(frame["seq"])
        cancelled_at = time.time()
        sent_at = time.monotonic()
        await client.send({"type": "cf_agent_chat_request_cancel", "id": request_id})
        late = 0
        while True:
            frame = await client.recv(30)
            if frame.get("type") == "cf_agent_use_chat_response" and frame.get("id") == request_id:
                if frame.get("done"):
                    done_ms = (time.monotonic() - sent_at) * 1000
                    break
                late += 1
    deltas = await sync_to_async(stored_deltas)(request_id)
    stamps = [stamp_of(delta) for _, delta in deltas]
    return {
        "after_cancel": sum(1 for s in stamps if s is not None and s > cancelled_at),
        "late": late,
        "missing": sum(1 for seq, _ in deltas if seq > received[-1]) - late,  # stored, never sent: 0
        "done_ms": done_ms,
        "stored": len(deltas),
    }


async def run(rounds: int, env: dict[str, str], logs: Any, label: str) -> None:
    from tests.support import start_daphne, start_worker

    procs = []
    try:
        daphne, port = start_daphne({**env, "DJANGO_CONN_MAX_AGE": "600"}, logs)
        procs.append(daphne)
        procs.append(start_worker(env, logs, name="bench-worker"))
        results = []
        for n in range(1, rounds + 1):
            results.append(await one_round(port))
            r = results[-1]
            progress(
                f"{label} round {n}/{rounds}: {r['after_cancel']} stored after the cancel, "
                f"{r['late']} arrived after it, cancel -> done {r['done_ms']:.1f} ms"
            )
        after = [r["after_cancel"] for r in results]
        print(
            f"\n{label}: stops with a chunk stored after the cancel: {sum(1 for a in after if a)} of {rounds}"
        )
        print(f"{label}: chunks stored after the cancel, total: {sum(after)}")
        late = summary([r["late"] for r in results])
        print(f"{label}: chunk frames arriving after the cancel was sent: {late}")
        print(f"{label}: chunks stored but never sent: {sum(r['missing'] for r in results)}")
        print(f"{label}: cancel -> done (ms): {summary([r['done_ms'] for r in results])}\n")
    finally:
        for proc in procs:
            proc.stop()


async def main(rounds: int) -> None:
    setup_django()
    with log_dir() as logs, scripted_model_process(logs, 20) as model_url:
        env = dict(os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=str(ROOT))
        await run(rounds, env, logs, "signal")
        await run(rounds, {**env, "THINK_CANCEL_SIGNALS": "0"}, logs, "flag only")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    asyncio.run(main(parser.parse_args().rounds))
