"""A plain Celery app for the recovery-latency baseline: one acks_late task on Redis, nothing else."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

BROKER = os.environ.get("BASELINE_BROKER_URL", "redis://127.0.0.1:6379/9")
app = Celery("baseline", broker=BROKER)
app.conf.task_acks_late = True
app.conf.worker_prefetch_multiplier = 1
app.conf.broker_connection_retry_on_startup = True
if os.environ.get("BASELINE_VISIBILITY_TIMEOUT"):
    app.conf.broker_transport_options = {"visibility_timeout": int(os.environ["BASELINE_VISIBILITY_TIMEOUT"])}


@app.task(name="baseline.long_task")
def long_task(marker: str, seconds: float = 600) -> None:
    """Record each start in Redis, then 'stream' for a while."""
    redis.Redis.from_url(BROKER).rpush(marker, time.time())
    time.sleep(seconds)
