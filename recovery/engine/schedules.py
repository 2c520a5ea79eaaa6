"""The beat schedule fragment a host merges into its own CELERY_BEAT_SCHEDULE."""

from __future__ import annotations

from typing import Any

from recovery.conf import DEFAULTS, setting


def recovery_tick_seconds() -> float:
    """The period of the recovery tick: THINK["RECOVERY_TICK_S"], 1 s by default."""
    return float(setting("RECOVERY_TICK_S"))


def beat_schedule(tick_seconds: float = DEFAULTS["RECOVERY_TICK_S"]) -> dict[str, Any]:
    """The recovery tick, every `tick_seconds` (pass THINK["RECOVERY_TICK_S"] when you set it: settings
    are not readable while they load), the stream buffer sweep every minute and the closed incidents'
    retention sweep every hour; missed runs expire."""
    seconds = float(tick_seconds)
    return {
        "think-recovery-tick": {
            "task": "think.recovery_tick",
            "schedule": seconds,
            "options": {"expires": max(seconds * 0.9, 0.5)},
        },
        "think-streams-sweep": {"task": "think.streams_sweep", "schedule": 60.0, "options": {"expires": 50}},
        "think-incidents-sweep": {
            "task": "think.incidents_sweep",
            "schedule": 3600.0,
            "options": {"expires": 3000},
        },
    }
