"""Recovery work sent to a worker: a fiber to recover, an alarm to fire.

Sent by the tasks' names, so the modules that send it (the engine, the liveness poll, the tick, the
operators' actions, the owning app's alarms) do not import recovery.tasks, which imports them to run it.
"""

from __future__ import annotations

from typing import Any

from celery import current_app

RECOVER_FIBER = "think.recover_fiber"
FIRE_ALARM = "think.fire_alarm"


def recover_later(fiber_id: str) -> None:
    """`think.recover_fiber` for the fiber (its id as text), on a worker."""
    current_app.send_task(RECOVER_FIBER, args=[fiber_id])


def fire_later(alarm_id: Any) -> None:
    """`think.fire_alarm` for a claimed alarm, on a worker."""
    current_app.send_task(FIRE_ALARM, args=[alarm_id])
