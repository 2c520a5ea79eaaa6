"""Recovery latency (P2): SIGKILL of the worker running a turn -> first continued chunk at the client.

Two turn workers run, as in any real deployment; the one holding the turn's lease is killed with
SIGKILL mid-stream and replaced (outside the timed window). It is measured with each detector of a
dead worker, in one run: its lost liveness session (recovery.lease.liveness: THINK["LIVENESS_CONFIRM_MS"],
300 ms, and the workers' poll, 250 ms) and, with the sessions off, its lease alone
(THINK["LEASE_TTL_S"], 3 s, THINK["HEARTBEAT_INTERVAL_S"], 1 s, and the beat tick, 1 s).

    .venv/bin/python bench/recovery_latency.py --rounds 30
    .venv/bin/python bench/recovery_latency.py --rounds 10 --detectors lease
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


DETECTORS = {"session": {}, "lease": {"THINK_LIVENESS_SESSIONS": "0"}}


async def main(rounds: int, detectors: list[str]) -> None:
    setup_django()
    results = {detector: await measure(rounds, detector) for detector in detectors}
    print()
    for detector, latencies in results.items():
        print(f"recovery latency, {detector} detector (s): {summary(latencies)}")
    print(
        "settings: LEASE_TTL_S=3.0 HEARTBEAT_INTERVAL_S=1.0 tick=1.0 s; LIVENESS_CONFIRM_MS=300"
        " LIVENESS_POLL_MS=250; 2 threads-pool workers"
    )


async def measure(rounds: int, detector: str) -> list[float]:
    from tests.support import start_beat, start_daphne, start_worker

    with log_dir() as logs, scripted_model_process(logs, 20) as model_url:
        env = dict(os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=str(ROOT), **DETECTORS[detector])
        procs = []
        try:
            daphne, port = start_daphne({**env, "DJANGO_CONN_MAX_AGE": "600"}, logs)
            procs.append(daphne)
            procs.append(start_beat(env, logs))
            workers = [start_worker(env, logs, name="bench-worker") for _ in range(2)]
            latencies: list[float] = []
            for n in range(1, rounds + 1):
                latency = await one_round(port, workers, env, logs)
                if latency != latency:  # NaN: skipped round
                    progress(f"{detector} round {n}/{rounds}: skipped (no live owner to kill)")
                    continue
                latencies.append(latency)
                progress(f"{detector} round {n}/{rounds}: SIGKILL -> first continued chunk {latency:.2f} s")
            return latencies
        finally:
            for proc in [*procs, *locals().get("workers", [])]:
                proc.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="kills per detector")
    parser.add_argument("--detectors", nargs="+", choices=list(DETECTORS), default=list(DETECTORS))
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.detectors))
