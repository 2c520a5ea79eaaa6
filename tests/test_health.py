"""GET /healthz: Postgres, the broker, the channel layer and the beat tick, through the Django test client."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
from django.conf import settings
from django.core.cache import cache
from django.test import Client, override_settings

from recovery import health
from recovery.heartbeat import KEY, beat_touch
from tests.support import free_port

pytestmark = pytest.mark.django_db


def get(client: Client) -> tuple[int, dict[str, Any]]:
    response = client.get("/healthz")
    assert response["Content-Type"] == "application/json"
    return response.status_code, response.json()


def closed_redis_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there once free_port closed it


def test_healthy_when_every_check_passes(client: Client) -> None:
    beat_touch()
    status, body = get(client)
    assert status == 200
    assert body["status"] == "ok"
    assert set(body["checks"]) == {"postgres", "broker", "channel_layer", "beat"}
    assert all(check["ok"] for check in body["checks"].values())
    beat = body["checks"]["beat"]
    assert 0 <= beat["age_s"] < beat["max_age_s"] == health.beat_max_age_s()


def test_a_stale_beat_is_unhealthy_and_says_why(client: Client) -> None:
    cache.set(KEY, time.time() - 600, timeout=None)
    status, body = get(client)
    assert status == 503 and body["status"] == "error"
    beat = body["checks"]["beat"]
    assert beat["ok"] is False and beat["age_s"] >= 600
    assert "last recovery tick was" in beat["error"] and "is beat running" in beat["error"]
    assert body["checks"]["postgres"] == {"ok": True}


def test_a_beat_that_never_ticked_is_unhealthy(client: Client) -> None:
    cache.delete(KEY)
    status, body = get(client)
    assert status == 503
    assert body["checks"]["beat"]["error"] == "no recovery tick recorded yet"


def test_the_beat_limit_follows_the_tick_period() -> None:
    with override_settings(THINK={**settings.THINK, "RECOVERY_TICK_S": 10}):
        assert health.beat_max_age_s() == 3 * 10 + health.BEAT_SLACK_S


def test_an_unreachable_broker_is_unhealthy(client: Client) -> None:
    beat_touch()
    with override_settings(CELERY_BROKER_URL=closed_redis_url()):
        status, body = get(client)
    assert status == 503
    broker = body["checks"]["broker"]
    assert broker["ok"] is False and "ConnectionError" in broker["error"]
    assert body["checks"]["channel_layer"]["ok"] and body["checks"]["beat"]["ok"]


def test_an_unreachable_channel_layer_is_unhealthy(client: Client) -> None:
    beat_touch()
    layers = copy.deepcopy(settings.CHANNEL_LAYERS)
    layers["default"]["CONFIG"]["hosts"][0]["address"] = closed_redis_url()
    with override_settings(CHANNEL_LAYERS=layers):
        status, body = get(client)
    assert status == 503
    assert body["checks"]["channel_layer"]["ok"] is False
    assert body["checks"]["broker"]["ok"]


def test_a_failing_database_is_unhealthy(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    class Down:
        def cursor(self) -> Any:
            raise OSError("connection refused")

    beat_touch()
    monkeypatch.setattr(health, "connection", Down())
    status, body = get(client)
    assert status == 503
    assert body["checks"]["postgres"] == {"ok": False, "error": "OSError: connection refused"}


@pytest.mark.parametrize(
    ("layer", "url"),
    [
        (
            {
                "BACKEND": "channels_redis.core.RedisChannelLayer",
                "CONFIG": {"hosts": [{"address": "redis://h:1/2"}]},
            },
            "redis://h:1/2",
        ),
        (
            {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": ["redis://h:1/3"]}},
            "redis://h:1/3",
        ),
        (
            {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [("h", 6380)]}},
            "redis://h:6380",
        ),
        ({"BACKEND": "channels.layers.InMemoryChannelLayer"}, None),
    ],
)
def test_the_channel_layer_url_comes_from_its_settings(layer: dict[str, Any], url: str | None) -> None:
    with override_settings(CHANNEL_LAYERS={"default": layer}):
        assert health.channel_layer_url() == url


def test_an_in_memory_channel_layer_is_skipped(client: Client) -> None:
    beat_touch()
    with override_settings(CHANNEL_LAYERS={"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}):
        status, body = get(client)
    assert status == 200
    assert body["checks"]["channel_layer"] == {"ok": True, "skipped": "not a Redis channel layer"}


def test_health_refuses_writes(client: Client) -> None:
    assert client.post("/healthz").status_code == 405
