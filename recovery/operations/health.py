"""GET /healthz: Postgres, the broker, the channel layer and the recovery beat (docker-compose health checks).

200 with `{"status": "ok", "checks": {...}}` when every check passes, 503 with `"status": "error"`
otherwise. Each check is `{"ok": true}` or `{"ok": false, "error": "..."}`; the beat check also carries
`age_s` (seconds since the last recovery tick) and `max_age_s`. The tick runs on a worker when beat sends
it, so a fresh tick means both beat and a worker are alive.

The endpoint is open, so it says no more than it must and costs little: a failing dependency's error
is "unavailable" (its exception, which can name hosts, users and ports, goes to the log); the Redis
checks reuse one connection pool per URL for the process, the database check Django's connection; and
one result is served for THINK["HEALTH_CACHE_S"] (2 s), computed once however many requests wait for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe

from recovery.conf import setting
from recovery.engine.schedules import recovery_tick_seconds
from recovery.observe.heartbeat import beat_last_tick

logger = logging.getLogger(__name__)

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


_clients: dict[str, redis.Redis] = {}  # one client (and its connection pool) per URL, for the process
_clients_lock = threading.Lock()


def _client(url: str) -> redis.Redis:
    with _clients_lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = redis.Redis.from_url(
                url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
            )
        return client


def _ping(url: str) -> Check:
    _client(url).ping()
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


UNAVAILABLE = "unavailable"


def _run(name: str, check: Callable[[], Check]) -> Check:
    try:
        return check()
    except Exception as exc:  # any failure is reported, not raised; its text only to the log
        logger.warning("health check %s failed: %s: %s", name, type(exc).__name__, exc)
        return {"ok": False, "error": UNAVAILABLE}


def health_report() -> tuple[bool, dict[str, Check]]:
    checks = {name: _run(name, check) for name, check in CHECKS.items()}
    return all(check["ok"] for check in checks.values()), checks


_last: tuple[float, bool, dict[str, Check]] | None = None  # (when, healthy, checks)
_last_lock = threading.Lock()


def health_cached() -> tuple[bool, dict[str, Check]]:
    """The last report while it is younger than THINK["HEALTH_CACHE_S"]; else a new one, made by one
    request while the others that arrive meanwhile wait for it."""
    global _last
    ttl = float(setting("HEALTH_CACHE_S") or 0)
    with _last_lock:
        if _last is not None and ttl and time.monotonic() - _last[0] < ttl:
            return _last[1], _last[2]
        healthy, checks = health_report()
        _last = (time.monotonic(), healthy, checks)
        return healthy, checks


def health_forget() -> None:
    """Drop the cached report (tests; a check changed)."""
    global _last
    with _last_lock:
        _last = None


@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    healthy, checks = health_cached()
    return JsonResponse(
        {"status": "ok" if healthy else "error", "checks": checks}, status=200 if healthy else 503
    )
