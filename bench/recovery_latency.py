"""Recovery latency (P2): SIGKILL of the worker running a turn -> first continued chunk at the client.

Two turn workers run, as in any real deployment; the one holding the turn's lease is killed with
SIGKILL mid-stream and replaced (outside the timed window). The figure depends on THINK["LEASE_TTL_S"]
(default 3 s), THINK["HEARTBEAT_INTERVAL_S"] (1 s) and the beat tick (THINK_RECOVERY_TICK_S, 1 s).

    .venv/bin/python bench/recovery_latency.py --rounds 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
import uuid

from harness import ROOT, log_dir, progress, scripted_model_process, setup_django, summary  # type: ignore[import-not-found]


async def one_round(port: int, workers: list, env: dict, logs: object) -> float:  # type: ignore[type-arg]
    from recovery.models import Fiber
    from tests.support import (
        ChatClient,
        ConversationLog,
        chat_request,
        follow_conversation,
        start_worker,
        user_message,
    )

    name = f"bench-{uuid.uuid4().hex[:8]}"
    async with ChatClient(port, name) as client:
        request_id = uuid.uuid4().hex[:10]
        await client.send(chat_request(request_id, [user_message("count to 400 [rate 20]")]))
        log = await follow_conversation(
            client, until=lambda lg: len(lg.stream(request_id).chunks) >= 12, timeout=60
        )
        fiber = await Fiber.objects.aget(request_id=request_id)
        owner = fiber.lease_owner.split(":")
        victim = next((w for w in workers if len(owner) > 1 and str(w.popen.pid) == owner[1]), None)
        if victim is None:  # the lease moved on before the kill (an overloaded machine): not a sample
            await follow_conversation(client, log, timeout=120)
            return float("nan")
        owner_pid = victim.popen.pid
        os.kill(owner_pid, signal.SIGKILL)
        killed_at = time.monotonic()

        def continued(lg: ConversationLog) -> bool:
            return any(r != request_id and lg.streams[r].chunks for r in lg.order)

        await follow_conversation(client, log, until=continued, timeout=120)
        latency = time.monotonic() - killed_at
        workers.remove(victim)
        workers.append(start_worker(env, logs, name="bench-worker"))  # type: ignore[arg-type]
        await follow_conversation(client, log, timeout=120)
    return latency


async def main(rounds: int) -> None:
    setup_django()
    from tests.support import start_beat, start_daphne, start_worker

    with log_dir() as logs, scripted_model_process(logs, 20) as model_url:
        env = dict(os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=str(ROOT))
        procs = []
        try:
            daphne, port = start_daphne({**env, "DJANGO_CONN_MAX_AGE": "600"}, logs)
            procs.append(daphne)
            procs.append(start_beat(env, logs))
            workers = [start_worker(env, logs, name="bench-worker") for _ in range(2)]
            latencies = []
            for n in range(1, rounds + 1):
                latency = await one_round(port, workers, env, logs)
                if latency != latency:  # NaN: skipped round
                    progress(f"round {n}/{rounds}: skipped (no live owner to kill)")
                    continue
                latencies.append(latency)
                progress(f"round {n}/{rounds}: SIGKILL -> first continued chunk {latencies[-1]:.2f} s")
            print(f"\nrecovery latency (s): {summary(latencies)}")
            print("settings: LEASE_TTL_S=3.0 HEARTBEAT_INTERVAL_S=1.0 tick=1.0 s, 2 threads-pool workers")
        finally:
            for proc in [*procs, *locals().get("workers", [])]:
                proc.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    asyncio.run(main(parser.parse_args().rounds))
