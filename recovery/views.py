"""GET /metrics: the Prometheus exposition of recovery.metrics (multiprocess-aware)."""

from __future__ import annotations

import hmac

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client.exposition import choose_encoder

from .conf import setting
from .metrics import exposition_registry


@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """Open unless THINK["METRICS_TOKEN"] is set; then only with "Authorization: Bearer <token>"."""
    token = setting("METRICS_TOKEN")
    if token:
        scheme, _, offered = request.headers.get("Authorization", "").partition(" ")
        valid = hmac.compare_digest(offered.strip().encode(), str(token).encode())
        if scheme.lower() != "bearer" or not valid:
            response = HttpResponse("metrics need a bearer token\n", status=401, content_type="text/plain")
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(exposition_registry()), content_type=content_type)
