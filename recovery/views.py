"""GET /metrics: the Prometheus exposition of recovery.metrics (multiprocess-aware)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client.exposition import choose_encoder

from .metrics import exposition_registry


@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(exposition_registry()), content_type=content_type)
