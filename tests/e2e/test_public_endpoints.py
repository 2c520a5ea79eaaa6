"""The open HTTP endpoints from outside, over a real daphne started as the Procfile and compose start it
(--proxy-headers: the client address is taken from X-Forwarded-For). Issue 34: the demo served its
metrics to anyone who could reach it (row 7); /healthz told anyone the hosts, users and ports of the
site's services and opened new connections to them for every request (row 10)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import http_get, start_daphne

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def get(port: int, headers: dict[str, str]) -> tuple[int, bytes]:
    return http_get(port, "/metrics", headers=headers)


@pytest.fixture(scope="module")
def proxied(stack: Any, log_dir: Path) -> Iterator[tuple[int, int]]:
    """Two daphnes with --proxy-headers: one without a metrics token, one with."""
    open_one, open_port = start_daphne(stack.env, log_dir, options=("--proxy-headers",))
    env = {**stack.env, "THINK_METRICS_TOKEN": "scrape-me"}
    token_one, token_port = start_daphne(env, log_dir, options=("--proxy-headers",))
    yield open_port, token_port
    open_one.stop()
    token_one.stop()


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Forwarded-For": "203.0.113.9"},  # what a proxy in front of the site adds for a visitor
        {"X-Forwarded-For": "127.0.0.1"},  # a visitor who claims to be local
        {"X-Real-IP": "127.0.0.1"},
        {"Forwarded": "for=127.0.0.1"},
    ],
)
def test_metrics_are_refused_to_anyone_not_on_this_machine(
    proxied: tuple[int, int], headers: dict[str, str]
) -> None:
    open_port, token_port = proxied
    status, body = get(open_port, headers)
    assert status == 403, body[:200]
    assert b"think_" not in body
    # A scraper on this machine is served; from anywhere, the token is.
    status, body = get(open_port, {})
    assert status == 200 and b"think_" in body
    assert get(token_port, headers)[0] == 401
    assert get(token_port, {**headers, "Authorization": "Bearer scrape-me"})[0] == 200


class CountingListener:
    """A TCP port that accepts connections, counts them and hangs up: a Redis that is down, as far as a
    client can tell, and a record of how many connections the site opened to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_healthz_names_no_service_and_opens_no_connection_per_request(stack: Any, log_dir: Path) -> None:
    """A daphne whose Redis (broker, channel layer, cache) is unreachable behind credentials: 30 requests
    in a row get the generic text, and cost the Redis a bounded number of connection attempts."""
    redis_down = CountingListener()
    env = {**stack.env, "THINK_TEST_REDIS_URL": f"redis://admin:hunter2@127.0.0.1:{redis_down.port}"}
    daphne, port = start_daphne(env, log_dir, options=("--proxy-headers",))
    try:
        answers = [http_get(port, "/healthz") for _ in range(30)]
    finally:
        daphne.stop()
        redis_down.close()
    for status, body in answers:
        assert status == 503
        text = body.decode()
        for secret in ("hunter2", "admin", str(redis_down.port), "127.0.0.1", "Error"):
            assert secret not in text, (secret, text)
    checks = json.loads(answers[0][1])["checks"]
    assert checks["broker"] == checks["channel_layer"] == {"ok": False, "error": "unavailable"}
    assert checks["postgres"] == {"ok": True}
    # One round of checks for the 30 requests (HEALTH_CACHE_S): a few attempts per Redis client (redis-py
    # retries), never some per request.
    assert redis_down.accepted < 30, redis_down.accepted
    assert "health check broker failed" in daphne.log(), "the details are in the web process's log"
