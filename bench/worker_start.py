"""A worker's start: time to ready, a cold recovery, and what each process holds idle.

- ready: from the `celery worker` exec to its " ready." line (a threads-pool worker, as `make run` starts);
- cold recovery: the only worker is SIGKILLed mid-stream, a new one is started 1 s later (as the
  Procfile's worker loop restarts it), and the time is taken from the SIGKILL to the continuation's first
  new words at the client (what a deploy or a crash with no second worker costs); the first chunk of the
  continued stream, which comes before the model's first words, is printed per round too;
- idle memory: the resident set of a ready worker, daphne and beat, each 3 s after it started.

    .venv/bin/python bench/worker_start.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from harness import ROOT, log_dir, progress, scripted_model_process, setup_django, summary  # type: ignore[import-not-found]
from procstat import rss_bytes, tree_pids  # type: ignore[import-not-found]

RESTART_AFTER_S = 1.0


def timed_worker(env: dict[str, str], logs: Any) -> tuple[Any, float]:
    from tests.support import start_worker

    started = time.monotonic()
    worker = start_worker(env, logs, name="bench-worker")
    return worker, time.monotonic() - started


def idle_mb(proc: Any) -> float:
    return rss_bytes(tree_pids(proc.popen.pid)) / 2**20


async def cold_recovery(port: int, env: dict[str, str], logs: Any, worker: Any) -> tuple[float, Any]:
    """SIGKILL the only worker mid-stream, start another RESTART_AFTER_S later: seconds to the first
    continued chunk, and the new worker."""
    from tests.support import ChatClient, ConversationLog, chat_request, follow_conversation, user_message

    name = f"bench-cold-{uuid.uuid4().hex[:8]}"
    async with ChatClient(port, name) as client:
        request_id = uuid.uuid4().hex[:10]
        await client.send(chat_request(request_id, [user_message("count to 200 [rate 20]")]))
        log = await follow_conversation(client, until=lambda lg: len(lg.stream(request_id).chunks) >= 10)
        os.killpg(worker.popen.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.sleep(RESTART_AFTER_S)
        new_worker = (await asyncio.to_thread(timed_worker, env, logs))[0]

        def continued(lg: ConversationLog) -> bool:
            return any(r != request_id and lg.streams[r].chunks for r in lg.order)

        def new_words(lg: ConversationLog) -> bool:
            return any(r != request_id and lg.streams[r].text for r in lg.order)

        await follow_conversation(client, log, until=continued, timeout=120)
        first_chunk = time.monotonic() - killed_at
        await follow_conversation(client, log, until=new_words, timeout=120)
        latency = time.monotonic() - killed_at
        progress(f"first continued chunk {first_chunk:.2f} s, first new words {latency:.2f} s")
        await follow_conversation(client, log, timeout=120)
    return latency, new_worker


async def main(rounds: int, keep_logs: bool) -> None:
    from tests.support import start_beat, start_daphne

    setup_django()
    with log_dir() as logs, scripted_model_process(logs, 20) as model_url:
        env = dict(os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=str(ROOT))
        procs: list[Any] = []
        try:
            daphne, port = start_daphne({**env, "DJANGO_CONN_MAX_AGE": "600"}, logs)
            beat = start_beat(env, logs)
            procs += [daphne, beat]
            ready: list[float] = []
            for n in range(1, rounds + 1):
                worker, seconds = timed_worker(env, logs)
                ready.append(seconds)
                progress(f"round {n}/{rounds}: ready in {seconds:.2f} s")
                worker.stop()
            worker, _ = timed_worker(env, logs)
            procs.append(worker)
            await asyncio.sleep(3)
            memory = {"worker": idle_mb(worker), "daphne": idle_mb(daphne), "beat": idle_mb(beat)}
            cold: list[float] = []
            for n in range(1, rounds + 1):
                latency, worker = await cold_recovery(port, env, logs, procs.pop())
                procs.append(worker)
                cold.append(latency)
                progress(f"round {n}/{rounds}: cold recovery {latency:.2f} s")
        finally:
            for proc in procs:
                proc.stop()
            if keep_logs:
                kept = Path(tempfile.mkdtemp(prefix="worker-start-logs-"))
                shutil.copytree(logs, kept, dirs_exist_ok=True)
                print(f"logs: {kept}")
    print()
    print(f"ready (s): {summary(ready)}")
    what = f"cold recovery, SIGKILL -> the continuation's first words, new worker after {RESTART_AFTER_S} s"
    print(f"{what} (s): {summary(cold)}")
    print("idle resident memory (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in memory.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--keep-logs", action="store_true", help="print where a copy of the processes' logs is"
    )
    arguments = parser.parse_args()
    asyncio.run(main(arguments.rounds, arguments.keep_logs))
