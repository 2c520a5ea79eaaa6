"""Celery tasks of the recovery app: the beat tick and the work it hands out. They take ids only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import shared_task
from celery.signals import worker_process_init, worker_ready

from recovery.process import dispatch, runtime

logger = logging.getLogger(__name__)


@shared_task(name="think.recovery_tick", ignore_result=True)
def recovery_tick(limit: int | None = None) -> dict[str, int]:
    """The beat's tick (recovery.engine.detection.tick)."""
    from recovery.engine.detection import tick

    return tick(limit=limit)


@shared_task(name=dispatch.RECOVER_FIBER, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def recover_fiber(fiber_id: str) -> None:
    from recovery.engine.spine import arecover_fiber

    runtime.run(arecover_fiber(fiber_id))


@shared_task(name=dispatch.FIRE_ALARM, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def fire_alarm(alarm_id: Any) -> None:
    from recovery.engine.alarms import afire_alarm

    runtime.run(afire_alarm(int(alarm_id)))


@shared_task(name="think.streams_sweep", ignore_result=True)
def streams_sweep() -> int:
    """Delete stream buffers past their retention (see recovery.operations.retention)."""
    from recovery.operations.retention import streams_sweep as sweep

    return sweep()


@shared_task(name="think.incidents_sweep", ignore_result=True)
def incidents_sweep() -> int:
    """Delete closed incidents, and faults, past THINK["INCIDENT_RETENTION_DAYS"]
    (recovery.operations.retention)."""
    from recovery.operations.retention import faults_sweep
    from recovery.operations.retention import incidents_sweep as sweep

    faults_sweep()
    return sweep()


@worker_ready.connect
def start_liveness(sender: object = None, **kwargs: object) -> None:
    """The process that runs the turns holds a liveness session (recovery.lease.liveness): the worker
    itself, unless a prefork pool runs them in its children (they start theirs as they start)."""
    from celery.concurrency.prefork import TaskPool as PreforkPool

    from recovery.lease import liveness

    if not isinstance(getattr(sender, "pool", None), PreforkPool):
        liveness.start(judges=_consumes_recovery_queue(sender))


def _consumes_recovery_queue(consumer: Any) -> Callable[[], bool] | None:
    """Whether the worker consumes the queue that takeovers send recovery work to (its app's default
    queue): a worker parked on, or serving, other queues only leaves the dead to those that do."""
    if getattr(consumer, "app", None) is None:
        return None
    queue = consumer.app.conf.task_default_queue

    def judges() -> bool:
        tasks = getattr(consumer, "task_consumer", None)  # replaced when the broker connection is
        return tasks is not None and bool(tasks.consuming_from(queue))

    return judges


@worker_process_init.connect
def start_liveness_in_child(**kwargs: object) -> None:
    from recovery.lease import liveness

    liveness.start()
