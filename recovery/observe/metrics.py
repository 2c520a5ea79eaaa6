"""Prometheus metrics of durable turns: module-level metrics with low-cardinality labels, never an id.

- `think_turns_total{outcome}`: turns that ended: completed, error, aborted or interrupted.
- `think_recoveries_total{outcome,reason}`: recoveries that reached completed, skipped, failed or
  exhausted; `reason` is a known reason (`max_attempts_exceeded`, `conversation_changed`, ...), `none`, or
  `other` (a hook's exception text never becomes a label).
- `think_incidents_open{status}`: live incidents (detected, scheduled, attempting), read from Postgres
  when scraped.
- `think_stream_chunk_latency_seconds`: per flushed batch, how long its oldest chunk waited between the
  model's delta and the publication of its frame (stored first, then published).
- `think_stream_flush_chunks`: chunks per flushed segment.
- `think_model_tokens_total{kind}` (input, output, cached) and `think_model_cost_total`: what the model's
  completed steps used and cost (`chat:step:usage`).
- `think_lease_expiries_total{status}`: fibers the recovery tick claimed because their lease lapsed:
  `running` (a worker's) or `interrupted` (a recovery handler's deadline).

Turn and recovery counts come from the diagnostic events (`chat:turn:finish`, `chat:recovery:*`) through
the `chat_event` signal; the stream writer observes once per flush, never per chunk.

With `PROMETHEUS_MULTIPROC_DIR` set (before this module is imported), every process writes its values
there and `/metrics` merges them (prometheus_client's multiprocess mode); otherwise the default registry
of the serving process is exposed.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from recovery.budget.incidents import EXHAUSTION_REASONS, LIVE_STATUSES, RECOVERY_ERROR, STABLE_TIMEOUT

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_HOST = socket.gethostname()


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def _process_identifier() -> str:
    return f"{_HOST}-{os.getpid()}"


def _configure_multiprocess() -> None:
    path = multiprocess_dir()
    if path is None:
        return
    os.makedirs(path, exist_ok=True)
    # Containers that share the directory each have their own PID namespace (web, worker and beat may all
    # be pid 1): the host name keeps their files apart. The file names stay `<type>_<id>.db`.
    values.ValueClass = values.MultiProcessValue(process_identifier=_process_identifier)


_configure_multiprocess()

TURNS = Counter("think_turns", "Turns that ended, by outcome.", ["outcome"])
STREAM_FILLS = Counter(
    "think_stream_fills",
    "Times a connection read from Postgres what the channel layer did not deliver: a gap before a "
    "later frame, or a stream that fell silent.",
    ["cause"],
)
RECOVERIES = Counter(
    "think_recoveries", "Recoveries that reached an outcome, with its reason.", ["outcome", "reason"]
)
LEASE_EXPIRIES = Counter(
    "think_lease_expiries",
    "Fibers claimed by the recovery tick because their lease lapsed, by the status they had.",
    ["status"],
)
SESSION_LOSSES = Counter(
    "think_session_losses",
    "Fibers taken over because the worker process that held them lost its liveness session (it died).",
)
CHUNK_LATENCY = Histogram(
    "think_stream_chunk_latency_seconds",
    "Per flushed batch: seconds from the oldest chunk's model delta to the publication of its frame.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
FLUSH_CHUNKS = Histogram(
    "think_stream_flush_chunks",
    "Chunks per flushed stream segment.",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500),
)

MODEL_TOKENS = Counter(
    "think_model_tokens", "Tokens the model's completed steps used, by kind: input, output, cached.", ["kind"]
)
MODEL_COST = Counter(
    "think_model_cost",
    "Cost of the model's priced steps, in the currency of the prices (litellm's map: US dollars).",
)

TURN_OUTCOMES = frozenset({"completed", "error", "aborted", "interrupted"})
RECOVERY_OUTCOMES = frozenset({"completed", "skipped", "failed", "exhausted"})
RECOVERY_REASONS = frozenset(
    {
        *EXHAUSTION_REASONS,
        STABLE_TIMEOUT,
        RECOVERY_ERROR,
        "forced",
        "continue_disabled",
        "stream_terminal",
        "not_recoverable",
        "awaiting_client_interaction",
        "submission_not_running",
        "no_unanswered_user_message",
        "conversation_changed",
    }
)
_FAILED_REASONS = {"recovered turn error": "turn_error", "recovered turn aborted": "turn_aborted"}


# --------------------------------------------------------------------------------------------------------
# Observations
# --------------------------------------------------------------------------------------------------------


def turn_finished(outcome: str) -> None:
    TURNS.labels(outcome=outcome if outcome in TURN_OUTCOMES else "other").inc()


def recovery_reason(reason: Any) -> str:
    """A label value for a recovery reason: a known one, `none`, or `other`."""
    if not reason:
        return "none"
    text = str(reason)
    return text if text in RECOVERY_REASONS else _FAILED_REASONS.get(text, "other")


def recovery_ended(outcome: str, reason: Any) -> None:
    RECOVERIES.labels(outcome=outcome, reason=recovery_reason(reason)).inc()


def chat_event_observed(sender: Any, **event: Any) -> None:
    """Receiver of `recovery.signals.chat_event`: counts finished turns and recovery outcomes."""
    event_type: str = event["type"]
    payload: dict[str, Any] = event.get("payload") or {}
    if event_type == "chat:turn:finish":
        turn_finished(str(payload.get("status")))
    elif event_type == "chat:step:usage":
        step_spend_observed(payload)
    elif event_type.startswith("chat:recovery:"):
        outcome = event_type.rsplit(":", 1)[1]
        if outcome in RECOVERY_OUTCOMES:
            recovery_ended(outcome, payload.get("reason"))


def step_spend_observed(payload: dict[str, Any]) -> None:
    """One completed model step's usage (`chat:step:usage`); its cost is a decimal string or None."""
    for kind in ("input", "output", "cached"):
        tokens = payload.get(f"{kind}Tokens")
        if isinstance(tokens, int) and tokens > 0:
            MODEL_TOKENS.labels(kind=kind).inc(tokens)
    cost = payload.get("cost")
    if cost is not None:
        try:
            MODEL_COST.inc(float(cost))
        except (TypeError, ValueError):
            logger.warning("step cost %r is not a number", cost)


def flush_observed(*, chunks: int, oldest_age_s: float) -> None:
    """One flushed batch: its size and how long its oldest chunk waited until it was published."""
    FLUSH_CHUNKS.observe(chunks)
    CHUNK_LATENCY.observe(oldest_age_s)


def session_losses_observed(count: int) -> None:
    if count:
        SESSION_LOSSES.inc(count)


def lease_expiries_observed(statuses: Iterable[str]) -> None:
    for status, count in Tally(statuses).items():
        LEASE_EXPIRIES.labels(status=status).inc(count)


# --------------------------------------------------------------------------------------------------------
# Exposition
# --------------------------------------------------------------------------------------------------------


class OpenIncidentsCollector:
    """`think_incidents_open{status}`, counted in Postgres at scrape time (so right in every process)."""

    name = "think_incidents_open"
    documentation = "Live recovery incidents, by status."

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.name, self.documentation, labels=["status"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            counts = _open_incident_counts()
        except Exception:  # the rest of the scrape is still worth having
            logger.exception("could not count open incidents")
            return
        gauge = GaugeMetricFamily(self.name, self.documentation, labels=["status"])
        for status in sorted(LIVE_STATUSES):
            gauge.add_metric([status], counts.get(status, 0))
        yield gauge


def _open_incident_counts() -> dict[str, int]:
    # At scrape time only: the metrics are importable (and written) before Django is set up.
    from django.db.models import Count

    from recovery.models import Incident

    rows = Incident.objects.filter(status__in=LIVE_STATUSES).values("status").annotate(n=Count("id"))
    return {row["status"]: row["n"] for row in rows.order_by()}


class _Default:
    """The default registry as one collector of the exposition registry."""

    def collect(self) -> Iterable[Any]:
        return REGISTRY.collect()


def exposition_registry() -> CollectorRegistry:
    """What `/metrics` serves: every process's values in multiprocess mode, else this process's."""
    registry = CollectorRegistry()
    source: Collector = _Default()
    if multiprocess_dir() is not None:
        source = MultiProcessCollector(None)
    registry.register(source)
    registry.register(OpenIncidentsCollector())
    return registry
