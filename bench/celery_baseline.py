"""Baseline for P2: a plain Celery acks_late task on Redis, its worker SIGKILLed mid-task.

Measures the time from the SIGKILL to the task starting again on a fresh worker, the way
recovery_latency.py measures a turn. With Celery's defaults (visibility_timeout 3600 s) the task is
redelivered only after the visibility timeout plus kombu's restore sweep, so the wait is bounded by
--max-wait and reported as a lower bound; --visibility-timeout shows the formula at a measurable size.

    .venv/bin/python bench/celery_baseline.py --max-wait 120
    .venv/bin/python bench/celery_baseline.py --visibility-timeout 10
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

HERE = Path(__file__).resolve().parent
BROKER = "redis://127.0.0.1:6379/9"


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    args = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "baseline_app",
        "worker",
        "--pool",
        "prefork",
        "-c",
        "1",
        "--without-gossip",
        "--without-mingle",
        "-l",
        "info",
    ]
    out = open(log, "ab")  # noqa: SIM115 - lives as long as the worker
    proc = subprocess.Popen(
        args, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while " ready." not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError("baseline worker did not start")
        time.sleep(0.1)
    return proc


def main(args: argparse.Namespace) -> None:
    client = redis.Redis.from_url(BROKER)
    client.flushdb()
    env = dict(os.environ, BASELINE_BROKER_URL=BROKER, PYTHONPATH=str(HERE))
    if args.visibility_timeout:
        env["BASELINE_VISIBILITY_TIMEOUT"] = str(args.visibility_timeout)
    log = Path(f"/tmp/celery-baseline-{uuid.uuid4().hex[:6]}.log")
    sys.path.insert(0, str(HERE))
    from baseline_app import long_task  # type: ignore[import-not-found]

    first = start_worker(env, log)
    marker = f"baseline:{uuid.uuid4().hex[:8]}"
    long_task.delay(marker)
    while client.llen(marker) < 1:
        time.sleep(0.05)
    time.sleep(1)
    os.killpg(first.pid, signal.SIGKILL)
    killed = time.monotonic()
    second = start_worker(env, log)
    try:
        while client.llen(marker) < 2 and time.monotonic() - killed < args.max_wait:
            time.sleep(0.1)
        waited = time.monotonic() - killed
        vt = args.visibility_timeout or 3600
        if client.llen(marker) >= 2:
            print(f"plain acks_late task, visibility_timeout={vt}s: SIGKILL -> running again {waited:.1f} s")
        else:
            print(
                f"plain acks_late task, visibility_timeout={vt}s: not back within {args.max_wait:.0f} s"
                " (expected: visibility_timeout + up to 100 s of kombu's restore sweep)"
            )
    finally:
        os.killpg(second.pid, signal.SIGKILL)
        client.flushdb()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-wait", type=float, default=120)
    parser.add_argument("--visibility-timeout", type=int, default=0)
    main(parser.parse_args())
