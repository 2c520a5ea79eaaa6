"""GET /metrics from outside, over a real daphne started as the Procfile and compose start it
(--proxy-headers: the client address is taken from X-Forwarded-For). Issue 34 row 7: the demo served
its metrics to anyone who could reach it."""

from __future__ import annotations

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
