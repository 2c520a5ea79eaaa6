"""The span of a recovery attempt (the engine's handling of one interrupted fiber): a child of the run
that was interrupted, whose context the fiber stored, so both are in one trace (recovery.observe.tracing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from recovery.observe.tracing import annotate, fail, span

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from recovery.budget.incidents import Incident
    from recovery.engine.targets import Interrupted

ATTEMPT = "think.recovery.attempt"
_attempt: ContextVar[Span | None] = ContextVar("think_recovery_attempt", default=None)


@contextmanager
def attempt_span(work: Interrupted) -> Iterator[None]:
    """The span of one recovery attempt, a child of the interrupted run (its stored context)."""
    attributes = {
        "think.fiber.id": str(work.fiber_id),
        "think.conversation.id": work.owner_id,
        "think.request.id": work.request_id,
        "think.request.root_id": work.root_request_id,
        "think.recovery.interruption": work.interruption or None,
    }
    with span(ATTEMPT, attributes=attributes, parent=work.trace) as made:
        token = _attempt.set(made)
        try:
            yield
        finally:
            _attempt.reset(token)


def attempt_incident(incident: Incident) -> None:
    """The incident the attempt counts against."""
    annotate(
        _attempt.get(),
        {
            "think.incident.id": incident.incident_id,
            "think.recovery.attempt": incident.attempt,
            "think.recovery.max_attempts": incident.max_attempts,
            "think.recovery.kind": incident.recovery_kind,
        },
    )


def attempt_outcome(outcome: str, *, reason: str | None = None, **extra: Any) -> None:
    """How the attempt ended: "scheduled", "skipped", "stopped", "exhausted" or "failed" (outside an attempt,
    a give-up of the alarm path, nothing)."""
    details = {f"think.recovery.{key}": value for key, value in extra.items()}
    annotate(_attempt.get(), {"think.recovery.outcome": outcome, "think.recovery.reason": reason, **details})
    if outcome in ("exhausted", "failed"):
        fail(_attempt.get(), reason)
