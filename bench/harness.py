"""Shared pieces of the benchmarks: a dedicated database, the real processes, progress lines."""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BENCH_DB = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/thinkproject_bench")
os.environ["DATABASE_URL"] = BENCH_DB
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "thinkproject.settings")
# As in production: DEBUG keeps every query in memory and wraps every cursor.
os.environ.setdefault("DJANGO_DEBUG", "0")
# With DEBUG off a process refuses a public key (think_chat.E026): the run's processes share a fresh one.
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# A benchmark is a flood by design, mostly from one principal: the per-principal limits are lifted
# (bench/overload.py --max-active sets one back; bench/limits.py measures them).
for _limit in (
    "PRINCIPAL_MAX_ACTIVE_TURNS",
    "PRINCIPAL_TURNS_PER_MINUTE",
    "PRINCIPAL_TOKENS_PER_DAY",
    "ANONYMOUS_TURNS_PER_MINUTE_PER_ADDRESS",
    "PRINCIPAL_MAX_SOCKETS",
    "ANONYMOUS_SOCKETS_PER_ADDRESS",
    "PRINCIPAL_MAX_CONVERSATIONS",
    "ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS",
    "PRINCIPAL_REPLAYS_PER_MINUTE",
):
    os.environ.setdefault(f"THINK_{_limit}", "none")
# Keep the benchmark's queues and groups away from a dev stack on the same Redis.
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/10")
os.environ.setdefault("CHANNELS_REDIS_URL", "redis://127.0.0.1:6379/11")
os.environ.setdefault("CACHE_REDIS_URL", "redis://127.0.0.1:6379/12")


def setup_django() -> None:
    import django

    from thinkproject.bootstrap import ensure_database

    ensure_database()
    django.setup()
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, check=True)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> str:
    return (
        f"n={len(values)} p50={percentile(values, 50):.2f} p95={percentile(values, 95):.2f} "
        f"min={min(values):.2f} max={max(values):.2f} mean={statistics.fmean(values):.2f}"
    )


@contextmanager
def log_dir() -> Iterator[Path]:
    """The processes' logs, deleted at the end unless BENCH_KEEP_LOGS is set (then their path is printed)."""
    if os.environ.get("BENCH_KEEP_LOGS"):
        path = Path(tempfile.mkdtemp(prefix="thinkbench-"))
        yield path
        print(f"logs: {path}")
        return
    with tempfile.TemporaryDirectory(prefix="thinkbench-") as kept:
        yield Path(kept)


def logs_done(logs: Path, code: int, keep: bool) -> int:
    """Print where the processes' logs are when the run failed or they are to be kept; else delete them."""
    if code or keep:
        print(f"logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    return code


@contextmanager
def scripted_model_process(logs: Path, token_rate: float) -> Iterator[str]:
    """The scripted model in its own process (in a thread, it would share the GIL with the client)."""
    from tests.support import Proc, free_port, wait_until

    port = free_port()
    args = [
        sys.executable,
        "-m",
        "think_scripted.server",
        "--port",
        str(port),
        "--token-rate",
        str(token_rate),
    ]
    proc = Proc("model", args, dict(os.environ), logs / "model.log").start()
    try:
        wait_until(lambda: _up(port), 20, "the scripted model")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.stop()


def _up(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
            return True
    except OSError:
        return False
