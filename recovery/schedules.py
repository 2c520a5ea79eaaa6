"""The beat schedule fragment a host merges into its own CELERY_BEAT_SCHEDULE."""

from __future__ import annotations

import os
from typing import Any


def recovery_tick_seconds() -> float:
    """The period of the recovery tick: THINK_RECOVERY_TICK_S, 1 s by default."""
    return float(os.environ.get("THINK_RECOVERY_TICK_S", "1.0"))


def beat_schedule(tick_seconds: float | None = None) -> dict[str, Any]:
    """The recovery tick, every second by default (THINK_RECOVERY_TICK_S), and the stream buffer sweep
    every minute; missed runs expire."""
    seconds = tick_seconds if tick_seconds is not None else recovery_tick_seconds()
    return {
        "think-recovery-tick": {
            "task": "think.recovery_tick",
            "schedule": seconds,
            "options": {"expires": max(seconds * 0.9, 0.5)},
        },
        "think-streams-sweep": {"task": "think.streams_sweep", "schedule": 60.0, "options": {"expires": 50}},
    }


BEAT_SCHEDULE = beat_schedule()
