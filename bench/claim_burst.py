"""Claim burst: a worker that starts while hundreds of fibers are interrupted takes them over in batches.

N running fibers (one conversation each) are written straight into the database with leases that
lapsed a minute ago, half of them also naming a liveness key nobody holds (a dead worker process), as
a crash of every worker would leave them. Then beat and one worker (threads pool) start, and this
script samples every 50 ms how many are still running. Printed: the fibers taken over per recovery
tick and per liveness poll (from the worker's log), the takeovers seen per sample over time, the time
from the worker's start to the last takeover (the drain), and where the fibers ended.
THINK["RECOVERY_CLAIMS_PER_TICK"] bounds each tick and each poll (`--bound`).

    .venv/bin/python bench/claim_burst.py --fibers 300 --bound 50
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/thinkproject_claims")

from harness import progress, setup_django  # type: ignore[import-not-found]  # noqa: E402
from soak import use_private_redis  # type: ignore[import-not-found]  # noqa: E402

TICK_LINE = re.compile(r"recovery tick: (\d+) interrupted fibers")
POLL_LINE = re.compile(r"liveness: (\d+) fibers of dead workers")


def interrupted_fibers(count: int, owner: str) -> None:
    """`count` running fibers of `owner`, in conversations named after it, their leases lapsed."""
    from django.utils import timezone

    from chat.models import Conversation
    from recovery.models import Fiber

    past = timezone.now() - timedelta(minutes=1)
    dead_key = random.randrange(1, 2**62)
    conversations = Conversation.objects.bulk_create(
        Conversation(agent="assistant", name=f"{owner}-{i}") for i in range(count)
    )
    Fiber.objects.bulk_create(
        Fiber(
            conversation=conversation,
            request_id=uuid.uuid4().hex[:10],
            kind="chat",
            status=Fiber.Status.RUNNING,
            fencing=1,
            lease_owner=owner,
            lease_session=dead_key if i % 2 else None,
            lease_expires_at=past,
            heartbeat_at=past,
        )
        for i, conversation in enumerate(conversations)
    )


def main(args: argparse.Namespace) -> int:
    from tests.support import Proc, start_beat, start_worker

    logs = Path(tempfile.mkdtemp(prefix="thinkclaims-"))
    redis_proc, _ = use_private_redis(logs)
    procs: list[Proc] = [redis_proc]
    try:
        setup_django()
        from recovery.models import Fiber

        owner = f"dead-{uuid.uuid4().hex[:6]}"
        interrupted_fibers(args.fibers, owner)
        mine = Fiber.objects.filter(lease_owner=owner)
        root = str(Path(__file__).parent.parent)
        env = dict(
            os.environ, PYTHONPATH=root, LOG_LEVEL="INFO", THINK_RECOVERY_CLAIMS_PER_TICK=str(args.bound)
        )
        progress(f"{args.fibers} interrupted fibers written; starting beat and one worker")
        began = time.monotonic()
        worker = start_worker(env, logs, name="claims-worker", concurrency=args.concurrency)
        procs.append(worker)
        procs.append(start_beat(env, logs))
        timeline: list[tuple[float, int]] = []
        left = args.fibers
        deadline = time.monotonic() + args.budget
        while left and time.monotonic() < deadline:
            now_left = mine.filter(status=Fiber.Status.RUNNING).count()
            if now_left != left:
                timeline.append((time.monotonic() - began, left - now_left))
                left = now_left
            time.sleep(0.05)
        drain = timeline[-1][0] - timeline[0][0] if timeline else float("nan")
        time.sleep(args.settle)
        ends = Counter(
            Fiber.objects.filter(conversation__name__startswith=f"{owner}-").values_list("status", flat=True)
        )
        log = worker.log()
    finally:
        for proc in reversed(procs):
            proc.stop()
    ticks = [int(n) for n in TICK_LINE.findall(log)]
    polls = [int(n) for n in POLL_LINE.findall(log)]
    print(f"\nfibers: {args.fibers} interrupted (half with a dead liveness key), bound {args.bound}")
    print(f"per recovery tick: {ticks} (max {max(ticks, default=0)})")
    print(f"per liveness poll: {polls} (max {max(polls, default=0)})")
    print(
        "taken over, per 50 ms sample (s after the worker's start: count): "
        + ", ".join(f"{at:.2f}: {n}" for at, n in timeline)
    )
    print(f"largest batch seen in one sample: {max((n for _, n in timeline), default=0)}")
    print(
        f"drain, first takeover -> last: {drain:.2f} s; worker start -> last takeover: "
        f"{timeline[-1][0] if timeline else float('nan'):.2f} s (worker start-up included)"
    )
    print(f"still running after {args.budget:.0f} s: {left}")
    print(f"where they ended, {args.settle:.0f} s later: {dict(ends)}")
    shutil.rmtree(logs, ignore_errors=True)
    return 1 if left or max([*ticks, *polls], default=0) > args.bound else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fibers", type=int, default=300)
    parser.add_argument("--bound", type=int, default=50, help="THINK RECOVERY_CLAIMS_PER_TICK")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds to wait for the drain")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds to let the engine handle them")
    sys.exit(main(parser.parse_args()))
