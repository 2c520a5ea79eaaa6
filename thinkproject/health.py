"""GET /healthz: Postgres and Redis reachable (used by docker-compose health checks)."""

from __future__ import annotations

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse


def healthz(request: HttpRequest) -> JsonResponse:
    checks: dict[str, str] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["postgres"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
        checks["postgres"] = f"error: {exc}"
    for name, url in (("broker", settings.CELERY_BROKER_URL), ("channels", settings.CHANNELS_REDIS_URL)):
        try:
            redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2).ping()
            checks[name] = "ok"
        except redis.RedisError as exc:
            checks[name] = f"error: {exc}"
    healthy = all(value == "ok" for value in checks.values())
    return JsonResponse(
        {"status": "ok" if healthy else "error", "checks": checks}, status=200 if healthy else 503
    )
