"""Celery tasks of the recovery app: the beat tick and the work it hands out. They take ids only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import shared_task
from celery.signals import worker_process_init, worker_ready

from . import runtime

logger = logging.getLogger(__name__)

# Work an app adds to every recovery tick (name -> a function returning how many rows it settled).
_sweeps: dict[str, Callable[[], int]] = {}


def register_tick_sweep(name: str, sweep: Callable[[], int]) -> None:
    """Run `sweep` on every recovery tick (an app calls it in its AppConfig.ready()); its count is
    reported under `name` in the tick's result. A sweep that raises is logged and never stops the tick."""
    _sweeps[name] = sweep


@shared_task(name="think.recovery_tick", ignore_result=True)
def recovery_tick(limit: int | None = None) -> dict[str, int]:
    """Claim expired fibers and due alarms (one short SKIP LOCKED transaction, at most `limit` fibers:
    THINK["RECOVERY_CLAIMS_PER_TICK"] by default) and hand each out."""
    from .detection import claims_per_tick, fibers_requeue_stale, tick_claim
    from .heartbeat import beat_touch

    limit = claims_per_tick() if limit is None else limit
    claims = tick_claim(limit=limit)
    beat_touch()
    requeued = fibers_requeue_stale(limit=limit)
    swept = {name: _sweep(name, sweep) for name, sweep in _sweeps.items()}
    for fiber_id in claims.fibers:
        recover_fiber.delay(str(fiber_id))
    for alarm_id in claims.alarms:
        fire_alarm.delay(alarm_id)
    if claims.fibers or claims.alarms:
        logger.info(
            "recovery tick: %s interrupted fibers, %s due alarms", len(claims.fibers), len(claims.alarms)
        )
    return {"fibers": len(claims.fibers), "alarms": len(claims.alarms), "requeued": requeued, **swept}


def _sweep(name: str, sweep: Callable[[], int]) -> int:
    try:
        return sweep()
    except Exception:  # never let it stop the tick that drives recovery
        logger.exception("%s sweep failed", name)
        return 0


@shared_task(name="think.recover_fiber", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def recover_fiber(fiber_id: str) -> None:
    from .engine import recover_fiber as engine_recover_fiber

    runtime.run(engine_recover_fiber(fiber_id))


@shared_task(name="think.fire_alarm", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def fire_alarm(alarm_id: Any) -> None:
    from .alarms import fire_alarm as alarms_fire_alarm

    runtime.run(alarms_fire_alarm(int(alarm_id)))


@shared_task(name="think.streams_sweep", ignore_result=True)
def streams_sweep() -> int:
    """Delete stream buffers past their retention (see recovery.retention)."""
    from .retention import streams_sweep as sweep

    return sweep()


@shared_task(name="think.incidents_sweep", ignore_result=True)
def incidents_sweep() -> int:
    """Delete closed incidents, and faults, past THINK["INCIDENT_RETENTION_DAYS"] (see recovery.retention)."""
    from .retention import faults_sweep
    from .retention import incidents_sweep as sweep

    faults_sweep()
    return sweep()


@worker_ready.connect
def start_liveness(sender: object = None, **kwargs: object) -> None:
    """The process that runs the turns holds a liveness session (recovery.liveness): the worker
    itself, unless a prefork pool runs them in its children (they start theirs as they start)."""
    from celery.concurrency.prefork import TaskPool as PreforkPool

    from . import liveness

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
    from . import liveness

    liveness.start()
