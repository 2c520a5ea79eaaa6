"""GET /healthz: Postgres, the broker, the channel layer and the recovery beat (docker-compose health checks).

200 with `{"status": "ok", "checks": {...}}` when every check passes, 503 with `"status": "error"`
otherwise. Each check is `{"ok": true}` or `{"ok": false, "error": "..."}`; the beat check also carries
`age_s` (seconds since the last recovery tick) and `max_age_s`. The tick runs on a worker when beat sends
it, so a fresh tick means both beat and a worker are alive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe

from recovery.heartbeat import beat_last_tick
from recovery.schedules import recovery_tick_seconds

Check = dict[str, Any]
REDIS_TIMEOUT_S = 2.0
# The beat may miss a couple of ticks (a busy worker, a deploy) before it counts as stale.
BEAT_MISSED_TICKS = 3
BEAT_SLACK_S = 5.0


def beat_max_age_s() -> float:
    return BEAT_MISSED_TICKS * recovery_tick_seconds() + BEAT_SLACK_S


def check_postgres() -> Check:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return {"ok": True}


def _ping(url: str) -> Check:
    client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        client.ping()
    finally:
        client.close()
    return {"ok": True}


def check_broker() -> Check:
    return _ping(settings.CELERY_BROKER_URL)


def channel_layer_url() -> str | None:
    """The Redis URL of the default channel layer (None when it is not a Redis layer)."""
    layer: dict[str, Any] = settings.CHANNEL_LAYERS.get("default", {})
    hosts = layer.get("CONFIG", {}).get("hosts") or []
    if "redis" not in str(layer.get("BACKEND", "")).lower() or not hosts:
        return None
    host = hosts[0]
    if isinstance(host, dict):
        return str(host["address"])
    if isinstance(host, list | tuple):
        return f"redis://{host[0]}:{host[1]}"
    return str(host)


def check_channel_layer() -> Check:
    url = channel_layer_url()
    return {"ok": True, "skipped": "not a Redis channel layer"} if url is None else _ping(url)


def check_beat() -> Check:
    last = beat_last_tick()
    limit = beat_max_age_s()
    if last is None:
        return {"ok": False, "error": "no recovery tick recorded yet", "max_age_s": limit}
    age = round(max(0.0, time.time() - last), 3)
    if age > limit:
        error = f"the last recovery tick was {age:.1f} s ago (limit {limit:.1f} s): is beat running?"
        return {"ok": False, "error": error, "age_s": age, "max_age_s": limit}
    return {"ok": True, "age_s": age, "max_age_s": limit}


CHECKS: dict[str, Callable[[], Check]] = {
    "postgres": check_postgres,
    "broker": check_broker,
    "channel_layer": check_channel_layer,
    "beat": check_beat,
}


def _run(check: Callable[[], Check]) -> Check:
    try:
        return check()
    except Exception as exc:  # any failure is reported, not raised
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    checks = {name: _run(check) for name, check in CHECKS.items()}
    healthy = all(check["ok"] for check in checks.values())
    return JsonResponse(
        {"status": "ok" if healthy else "error", "checks": checks}, status=200 if healthy else 503
    )
