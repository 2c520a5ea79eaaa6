"""The full-origin match of the chat socket (chat.origins, issue 34 row 9): scheme, host and port."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.checks import run_checks
from django.test import override_settings

from chat.origins import Origin, origin_allowed, parse_origin


def scope(host: str, *, scheme: str | None = None, **headers: str) -> dict[str, Any]:
    raw = [
        (b"host", host.encode()),
        *((k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()),
    ]
    return {"type": "websocket", "headers": raw, **({"scheme": scheme} if scheme else {})}


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("https://Example.COM", Origin("https", "example.com", 443)),
        ("http://example.com:80", Origin("http", "example.com", 80)),
        ("http://example.com.", Origin("http", "example.com", 80)),
        ("http://[::1]:8000", Origin("http", "::1", 8000)),
        ("https://*.example.com", Origin("https", "*.example.com", 443)),
        ("null", None),
        ("example.com", None),
        ("ftp://example.com", None),
        ("http://example.com/path", None),
        ("http://example.com:99999", None),
        ("http://user@example.com", None),
        ("http://a.*.example.com", None),
        ("http://*", None),
    ],
)
def test_parse_origin(value: str, parsed: Origin | None) -> None:
    assert parse_origin(value) == parsed


@override_settings(ALLOWED_HOSTS=["example.com"], CSRF_TRUSTED_ORIGINS=[], SECURE_PROXY_SSL_HEADER=None)
def test_only_the_handshakes_own_origin_is_allowed() -> None:
    plain = scope("example.com")
    assert origin_allowed("http://example.com", plain)
    assert origin_allowed("http://EXAMPLE.com:80", plain)
    assert not origin_allowed("http://example.com:8080", plain)
    assert not origin_allowed("https://example.com", plain)
    assert not origin_allowed("http://sub.example.com", plain)
    secure = scope("example.com", scheme="wss")
    assert origin_allowed("https://example.com", secure)
    assert origin_allowed("https://example.com:443", secure)
    assert not origin_allowed("http://example.com", secure)
    on_port = scope("example.com:8443", scheme="wss")
    assert origin_allowed("https://example.com:8443", on_port)
    assert not origin_allowed("https://example.com", on_port)
    # A Host that is not one of ALLOWED_HOSTS is no origin of the site's.
    assert not origin_allowed("http://evil.example", scope("evil.example"))
    assert not origin_allowed("http://example.com", scope(""))


@override_settings(
    ALLOWED_HOSTS=["example.com"],
    CSRF_TRUSTED_ORIGINS=[],
    SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https"),
)
def test_behind_a_tls_proxy_the_scheme_is_djangos() -> None:
    proxied = scope("example.com", x_forwarded_proto="https")
    assert origin_allowed("https://example.com", proxied)
    assert not origin_allowed("http://example.com", proxied)
    assert origin_allowed("http://example.com", scope("example.com", x_forwarded_proto="http"))


@override_settings(
    ALLOWED_HOSTS=["example.com"],
    CSRF_TRUSTED_ORIGINS=["https://app.example.org", "https://*.example.net", "http://localhost:3000"],
    SECURE_PROXY_SSL_HEADER=None,
)
def test_trusted_origins_default_to_csrfs_and_match_in_full() -> None:
    s = scope("example.com")
    assert origin_allowed("https://app.example.org", s)
    assert origin_allowed("https://app.example.org:443", s)
    assert not origin_allowed("http://app.example.org", s)
    assert not origin_allowed("https://app.example.org:8443", s)
    assert not origin_allowed("https://x.app.example.org", s)
    assert origin_allowed("https://a.example.net", s)
    assert origin_allowed("https://a.b.example.net", s)
    assert not origin_allowed("https://a.example.net:8443", s)
    assert not origin_allowed("http://a.example.net", s)
    assert not origin_allowed("https://evilexample.net", s)
    assert origin_allowed("http://localhost:3000", s)
    assert not origin_allowed("http://localhost:3001", s)
    with override_settings(THINK={"TRUSTED_ORIGINS": ["https://only.example.org"]}):
        assert origin_allowed("https://only.example.org", s)
        assert not origin_allowed("https://app.example.org", s)


@pytest.mark.parametrize(
    "value", [["example.com"], ["https://example.com/path"], "https://example.com", [42]]
)
def test_malformed_trusted_origins_fail_the_system_check(value: Any) -> None:
    with override_settings(THINK={"TRUSTED_ORIGINS": value}):
        ids = [message.id for message in run_checks()]
    assert "think_chat.E027" in ids


def test_well_formed_trusted_origins_pass_the_system_check() -> None:
    with override_settings(THINK={"TRUSTED_ORIGINS": ["https://*.example.com", "http://localhost:3000"]}):
        ids = [message.id for message in run_checks()]
    assert "think_chat.E027" not in ids
