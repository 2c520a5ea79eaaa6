"""The spans of a chat turn: one per run of a turn on a worker, one per model step, one per tool call;
never one per chunk. The optional import, and the span of a recovery attempt, are
recovery.observe.tracing's.

A recovered turn is in the trace of the turn it recovers: its span is a child of the recovery attempt
that started it (itself a child of the interrupted run), with a link to that run. So one trace shows the
turn on the worker that died, the attempt that counted against the incident, and the worker that
finished it; a link alone would leave them in two traces. The link still names the run it recovers
directly, also where a backend draws no parent whose span never arrived (a killed worker exports
nothing). The contexts travel in the durable state: the run's own in its fiber's snapshot, the
recovery's in the alarm's payload and the new fiber's snapshot (TurnSnapshot.recovery_trace).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

from recovery.lease.fibers import fiber_trace_record
from recovery.observe import tracing
from recovery.process.runtime import db

from ..transcript.snapshot import FiberSnapshot

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from recovery.engine.targets import Interrupted

    from .llm import Usage
    from .runner import TurnRunner
    from .tools import ToolOutcome

logger = logging.getLogger(__name__)

TURN = "think.turn"
STEP = "think.step"
TOOL = "think.tool"
RECOVERS = {"think.link": "recovers"}  # the attributes of a recovered turn's link to the run it recovers


@asynccontextmanager
async def turn_span(runner: TurnRunner) -> AsyncIterator[None]:
    """The span of one run of a claimed turn; its context is stored in the fiber, for its recovery."""
    claim = runner.claim
    turn = FiberSnapshot.from_json(claim.snapshot).turn
    recovered = turn.recovery_trace if turn is not None else None
    recovered = recovered if isinstance(recovered, dict) else {}
    attributes = {
        "think.conversation.id": claim.conversation_id,
        "gen_ai.conversation.id": str(claim.conversation_id),
        "gen_ai.agent.name": claim.conversation.get("agent"),
        "think.request.id": claim.request_id,
        "think.request.root_id": turn.root_request_id if turn is not None else None,
        "think.fiber.id": str(claim.fiber_id),
        "think.turn.kind": claim.kind,
        "think.turn.continuation": runner.continuation,
        "think.incident.id": runner.incident_id,
    }
    links = [(recovered.get("recovers"), RECOVERS)]
    with tracing.span(TURN, attributes=attributes, parent=recovered.get("attempt"), links=links) as span:
        carrier = tracing.carrier_of(span)
        if carrier is not None:
            try:
                await db(fiber_trace_record, fiber_id=claim.fiber_id, fencing=claim.fencing, carrier=carrier)
            except Exception:  # a trace is never worth a turn; the turn meets a real outage itself
                logger.warning("the turn's trace context was not stored", exc_info=True)
        try:
            yield
        finally:
            ended = {
                "think.turn.outcome": runner.outcome,
                "think.turn.stop_reason": runner.stop_reason or runner.handed_over,
                "think.turn.chunks": runner.writer.next_seq if runner.writer is not None else None,
            }
            tracing.annotate(span, ended)
            if runner.outcome == "error":
                tracing.fail(span)


def recovery_trace(work: Interrupted) -> dict[str, Any] | None:
    """What the turn a recovery starts continues (TurnSnapshot.recovery_trace): the context of the
    current recovery attempt and that of the interrupted run; None when tracing recorded neither."""
    contexts = {"attempt": tracing.current_carrier(), "recovers": work.trace}
    kept = {key: carrier for key, carrier in contexts.items() if carrier}
    return kept or None


@contextmanager
def step_span(number: int) -> Iterator[Span | None]:
    """One model step: the model's answer streamed, the tool calls it asked for run after it."""
    with tracing.span(
        STEP, attributes={"gen_ai.operation.name": "chat", "think.step.number": number}
    ) as span:
        yield span


def step_ended(
    span: Span | None, *, model: str | None, finish_reason: str | None, usage: Usage | None
) -> None:
    tracing.annotate(
        span,
        {
            "gen_ai.request.model": model,
            "gen_ai.response.finish_reasons": [finish_reason] if finish_reason else None,
            "gen_ai.usage.input_tokens": usage.prompt_tokens if usage is not None else None,
            "gen_ai.usage.output_tokens": usage.completion_tokens if usage is not None else None,
        },
    )


@contextmanager
def tool_span(name: str, call_id: str) -> Iterator[Span | None]:
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.id": call_id,
    }
    with tracing.span(TOOL, attributes=attributes) as span:
        yield span


def tool_ended(span: Span | None, outcome: ToolOutcome) -> None:
    failed = outcome.error_text is not None
    tracing.annotate(span, {"think.tool.outcome": "error" if failed else "ok"})
    if failed:
        tracing.fail(span, outcome.detail or outcome.error_text)


def tool_not_run(name: str, call_id: str, outcome: str) -> None:
    """A call the worker does not run: "unknown_tool", "client" (the client answers it),
    "approval_requested" (a human decides first) or "invalid_input" (its input does not fit the tool's
    types: the model is told, and no human is asked to approve it)."""
    with tool_span(name, call_id) as span:
        tracing.annotate(span, {"think.tool.outcome": outcome})
