"""When the recovery tick last ran, for the health endpoint (beat freshness)."""

from __future__ import annotations

import time

from django.core.cache import cache

KEY = "think:recovery:last-tick"


def beat_touch() -> None:
    cache.set(KEY, time.time(), timeout=None)


def beat_last_tick() -> float | None:
    value = cache.get(KEY)
    return float(value) if value is not None else None
