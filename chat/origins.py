"""Which browser origins may open the chat socket: a full-origin match (scheme, host and port).

A browser sends the page's origin with every WebSocket handshake, and the socket carries the site's
cookies whatever page opened it. So the handshake's ``Origin`` must be the site itself, or one of
THINK["TRUSTED_ORIGINS"] (by default Django's CSRF_TRUSTED_ORIGINS, the same list a cross-origin form
post needs). A host match alone is not enough: a page on ``http://example.com:8080`` is another origin
than the site on ``https://example.com``, and must not ride its visitors' cookies.

"The site itself" is the origin of the handshake's own URL, as Django builds ``request.scheme`` and
``request.get_host()`` for a page: the ``Host`` header (one of ALLOWED_HOSTS), with ``http`` for a
``ws`` socket and ``https`` for ``wss``, or as SECURE_PROXY_SSL_HEADER says behind a TLS proxy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from django.conf import settings
from django.http.request import split_domain_port, validate_host
from django.utils.http import is_same_domain

from .conf import think_setting

DEFAULT_PORTS = {"http": 80, "https": 443}
SOCKET_SCHEMES = {"ws": "http", "wss": "https", "http": "http", "https": "https"}


class Origin(NamedTuple):
    """scheme, lowercased host (IPv6 without brackets; a leading "*." in a trusted pattern), port."""

    scheme: str
    host: str
    port: int


def parse_origin(value: str) -> Origin | None:
    """The origin `value` names (``scheme://host[:port]``, nothing after), default port filled in; None
    when it is not one (``null``, a path, an unknown scheme, a bad port)."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname or parts.username is not None or parts.password:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
        return None
    host = parts.hostname.rstrip(".")
    if "*" in host and not (host.startswith("*.") and "*" not in host[1:]):
        return None
    return Origin(scheme, host, port if port is not None else DEFAULT_PORTS[scheme])


def origin_problem(value: object) -> str | None:
    """Why `value` is not a usable THINK["TRUSTED_ORIGINS"] entry; None when it is (a system check)."""
    if not isinstance(value, str):
        return f"{value!r} is not a string"
    if parse_origin(value) is None:
        return f"{value!r} is not an origin: http or https, a host (or *.domain), an optional port, no path"
    return None


def trusted_origins() -> list[str]:
    """THINK["TRUSTED_ORIGINS"], or Django's CSRF_TRUSTED_ORIGINS when it is None (the default)."""
    configured = think_setting("TRUSTED_ORIGINS")
    return list(settings.CSRF_TRUSTED_ORIGINS if configured is None else configured)


def matches(origin: Origin, pattern: Origin) -> bool:
    """`origin` is `pattern`, or one of its subdomains for a "*.domain" pattern (as CSRF_TRUSTED_ORIGINS)."""
    if origin.scheme != pattern.scheme or origin.port != pattern.port:
        return False
    if pattern.host.startswith("*."):
        return is_same_domain(origin.host, pattern.host[1:])
    return origin.host == pattern.host


def allowed_hosts() -> list[str]:
    """ALLOWED_HOSTS as Django's get_host() reads it (local names only while DEBUG leaves it empty)."""
    allowed = list(settings.ALLOWED_HOSTS)
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    return allowed


def handshake_origin(scope: Mapping[str, Any]) -> Origin | None:
    """The origin of the socket's own URL: its Host header (when one of ALLOWED_HOSTS) and scheme."""
    headers = _headers(scope)
    host = headers.get("host", "")
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, allowed_hosts()):
        return None
    return parse_origin(f"{_scheme(scope, headers)}://{host}")


def origin_allowed(origin: str, scope: Mapping[str, Any]) -> bool:
    """Whether a browser page on `origin` may open the socket `scope` describes."""
    parsed = parse_origin(origin)
    if parsed is None:
        return False
    own = handshake_origin(scope)
    if own is not None and parsed == own:
        return True
    return any(matches(parsed, pattern) for pattern in _patterns(trusted_origins()))


def _patterns(entries: Iterable[str]) -> list[Origin]:
    return [pattern for entry in entries if isinstance(entry, str) and (pattern := parse_origin(entry))]


def _headers(scope: Mapping[str, Any]) -> dict[str, str]:
    return {
        bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1")
        for name, value in scope.get("headers") or ()
    }


def _scheme(scope: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    """http or https, as Django's HttpRequest.scheme: SECURE_PROXY_SSL_HEADER first, then the socket's."""
    if settings.SECURE_PROXY_SSL_HEADER:
        header, secure_value = settings.SECURE_PROXY_SSL_HEADER
        name = header.removeprefix("HTTP_").replace("_", "-").lower()
        if name in headers:
            return "https" if headers[name].split(",")[0].strip() == secure_value else "http"
    return SOCKET_SCHEMES.get(str(scope.get("scheme") or "ws").lower(), "http")
