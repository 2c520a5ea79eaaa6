"""Traces: OpenTelemetry spans of the work the layer runs, when the optional `opentelemetry` is installed.

Without it every function here does nothing (the `otel` extra installs the API; the site installs an
SDK and an exporter, docs/tracing.md). A span is a unit of work (a fiber's run, a recovery attempt),
never a chunk: nothing here is on the per-chunk path.

A span's context travels as W3C trace context headers (a `Carrier`), stored as JSON: a fiber's run
records its own in the fiber's snapshot (recovery.lease.fibers.TRACE_SLOT), so the recovery attempt of a fiber
whose worker died is a child of the run that died, in the same trace, on whichever process handles it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the optional dependency is absent: no spans
    trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanContext

# W3C trace context headers (`traceparent`, maybe `tracestate`): a span's context as stored JSON.
Carrier = dict[str, str]
Links = Sequence[tuple[Any, Mapping[str, Any]]]  # (a stored carrier or None, the link's attributes)

TRACER_NAME = "thinkproject"

# A proxy until the site sets its tracer provider, which it may do after the apps are imported.
tracer = trace.get_tracer(TRACER_NAME) if trace is not None else None
# Baggage is never stored: only the span's own context travels with the fiber.
_propagator = TraceContextTextMapPropagator() if trace is not None else None


@contextmanager
def span(
    name: str, *, attributes: Mapping[str, Any], parent: Any = None, links: Links = ()
) -> Iterator[Span | None]:
    """A span, current inside the block; None when tracing is off.

    `parent`: a stored carrier the span continues (else the current span is its parent). Attributes
    whose value is None are left out; an exception escaping the block is recorded on the span.
    """
    if trace is None or tracer is None:
        yield None
        return
    context = _context(parent)
    kept = [trace.Link(linked, dict(extra)) for carrier, extra in links if (linked := _linked(carrier))]
    with tracer.start_as_current_span(name, context=context, attributes=_set(attributes), links=kept) as made:
        yield made


def annotate(span: Span | None, attributes: Mapping[str, Any]) -> None:
    """Set the attributes whose value is not None."""
    if span is not None:
        span.set_attributes(_set(attributes))


def fail(span: Span | None, description: str | None = None) -> None:
    """Mark the span's work as failed (an error it ended with, not an exception that escaped it)."""
    if trace is not None and span is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, description))


def carrier_of(span: Span | None) -> Carrier | None:
    """The span's context to store; None when tracing is off or the span is not a real one."""
    if trace is None or _propagator is None or span is None or not span.get_span_context().is_valid:
        return None
    carrier: Carrier = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier or None


def current_carrier() -> Carrier | None:
    return carrier_of(trace.get_current_span()) if trace is not None else None


def _set(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in attributes.items() if value is not None}


def _context(carrier: Any) -> Context | None:
    """The context a stored carrier names; None (the current one) when it names none."""
    if _propagator is None or not isinstance(carrier, dict):
        return None
    headers = {k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)}
    context = _propagator.extract(headers)
    return context if _linked_in(context) is not None else None


def _linked(carrier: Any) -> SpanContext | None:
    context = _context(carrier)
    return None if context is None else _linked_in(context)


def _linked_in(context: Context) -> SpanContext | None:
    assert trace is not None
    linked = trace.get_current_span(context).get_span_context()
    return linked if linked.is_valid else None
