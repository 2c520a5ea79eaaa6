"""GET /healthz: Postgres, the broker, the channel layer and the beat tick, through the Django test client."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.cache import cache
from django.test import Client, override_settings

from recovery.observe.heartbeat import KEY, beat_touch
from recovery.operations import health
from tests.support import free_port

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_report() -> Iterator[None]:
    """Each test sees a report of its own settings, not one cached by the test before (HEALTH_CACHE_S)."""
    health.health_forget()
    yield
    health.health_forget()


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
    assert body["checks"]["broker"] == {"ok": False, "error": "unavailable"}
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
    assert body["checks"]["postgres"] == {"ok": False, "error": "unavailable"}


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


# -- what an outsider learns, and what a flood of requests costs (issue 34, row 10) ------------------------
def test_a_failing_dependency_names_no_host_user_or_port(
    client: Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The error text was the exception's: hosts, users and ports of the site's internal services."""
    port = free_port()

    class Down:
        def cursor(self) -> Any:
            raise OSError('connection to server at "db.internal" (10.0.0.5), port 5432 failed: user "admin"')

    beat_touch()
    monkeypatch.setattr(health, "connection", Down())
    with caplog.at_level(logging.WARNING, logger="recovery.operations.health"):
        with override_settings(CELERY_BROKER_URL=f"redis://admin:hunter2@127.0.0.1:{port}/0"):
            response = client.get("/healthz")
    assert response.status_code == 503
    body = response.content.decode()
    for secret in ("db.internal", "10.0.0.5", "admin", "hunter2", str(port), "127.0.0.1", "Error"):
        assert secret not in body, secret
    assert response.json()["checks"]["postgres"] == {"ok": False, "error": "unavailable"}
    assert response.json()["checks"]["broker"] == {"ok": False, "error": "unavailable"}
    logged = caplog.text
    assert "db.internal" in logged and str(port) in logged, "the details are in the log"


def test_requests_within_the_cache_time_share_one_round_of_checks(
    client: Client, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    runs = dict.fromkeys(health.CHECKS, 0)

    def counted(name: str, check: Any) -> Any:
        def run() -> Any:
            runs[name] += 1
            return check()

        return run

    monkeypatch.setattr(
        health, "CHECKS", {name: counted(name, check) for name, check in health.CHECKS.items()}
    )
    settings.THINK = {**settings.THINK, "HEALTH_CACHE_S": 0.5}
    beat_touch()
    for _ in range(20):
        assert client.get("/healthz").status_code == 200
    assert set(runs.values()) == {1}, runs
    time.sleep(0.6)
    client.get("/healthz")
    assert set(runs.values()) == {2}, runs


def test_checks_reuse_their_connections(
    client: Client, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """A new Redis connection per request and per check made the open endpoint an amplifier."""
    import redis.connection

    connects = []
    real_connect = redis.connection.Connection._connect

    def connect(self: Any) -> Any:  # a new socket (connect() itself is also called on a pooled one)
        connects.append(self.port)
        return real_connect(self)

    monkeypatch.setattr(redis.connection.Connection, "_connect", connect)
    settings.THINK = {**settings.THINK, "HEALTH_CACHE_S": 0}
    beat_touch()
    for _ in range(10):
        assert client.get("/healthz").status_code == 200
    # The broker, the channel layer and Django's cache (the beat check): at most one connection each,
    # however many requests.
    assert len(connects) <= 3, connects
