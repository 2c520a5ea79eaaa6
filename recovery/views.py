"""GET /metrics: the Prometheus exposition of recovery.observe.metrics (multiprocess-aware)."""

from __future__ import annotations

import hmac
import ipaddress

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client.exposition import choose_encoder

from recovery.conf import setting
from recovery.observe.metrics import exposition_registry

# Headers a proxy adds: a request that carries one came through a proxy (or claims to), whatever its
# client address says. daphne's --proxy-headers sets the client address from X-Forwarded-For itself.
FORWARDING_HEADERS = ("X-Forwarded-For", "X-Real-Ip", "Forwarded", "X-Forwarded-Host")


def is_local(request: HttpRequest) -> bool:
    """A client on this machine that came straight here: a loopback address and no proxy's header."""
    if any(name in request.headers for name in FORWARDING_HEADERS):
        return False
    try:
        return ipaddress.ip_address(request.META.get("REMOTE_ADDR") or "").is_loopback
    except ValueError:  # no address at all (a unix socket) or an unreadable one
        return False


@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """With THINK["METRICS_TOKEN"] set, only with "Authorization: Bearer <token>"; without one, only for a
    scraper on this machine (a loopback client, not through a proxy). Counts only, never ids or text."""
    token = setting("METRICS_TOKEN")
    if not token and not is_local(request):
        return HttpResponse(
            "metrics are served to this machine only unless THINK['METRICS_TOKEN'] is set\n",
            status=403,
            content_type="text/plain",
        )
    if token:
        scheme, _, offered = request.headers.get("Authorization", "").partition(" ")
        valid = hmac.compare_digest(offered.strip().encode(), str(token).encode())
        if scheme.lower() != "bearer" or not valid:
            response = HttpResponse("metrics need a bearer token\n", status=401, content_type="text/plain")
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(exposition_registry()), content_type=content_type)
