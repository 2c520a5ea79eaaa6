"""OpenTelemetry spans (chat.turn.tracing, recovery.observe.tracing), read from the SDK's in-memory
exporter.

Turns run in the test process against the scripted model, as Think.chat() runs them. A recovered turn is
driven in-process through the real path: a turn stopped mid-stream by a worker shutdown, the tick's
takeover of its lapsed lease, the engine, the continue alarm, and the continuation's run. Without the
`opentelemetry` package (its import made to fail) the same turns and the same recovery run, with no span.
"""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import chat.transcript.turns
import chat.turn.tracing
import recovery.observe.tracing
import recovery.tasks
from chat.agents import open_agent
from chat.transcript.snapshot import FiberSnapshot
from chat.turn.interrupted import CONTINUE_CALLBACK
from chat.turn.runner import TurnRunner, turn_run
from recovery.engine.alarms import afire_alarm
from recovery.engine.spine import arecover_fiber
from recovery.lease.fibers import TRACE_SLOT
from recovery.models import Alarm, Fiber
from tests.inprocess import interrupted_turn
from tests.support import TEST_PRINCIPAL

# in_process_model: its stack_environment ends, with the run, the connections the turns' DB threads leave
# open (ending them here would break later modules that share the async ORM's thread).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("in_process_model")]

ADD = '[tool add {"tag": "trace", "a": 1, "b": 2}]'
EXPLODE = '[tool explode {"tag": "trace"}]'


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """The apps' tracer, from an SDK provider of this test's own (the process's global one is left alone,
    so no other test records spans or stores trace contexts)."""
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    monkeypatch.setattr(recovery.observe.tracing, "tracer", provider.get_tracer("tests"))
    return exported


@pytest.fixture
def without_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The tracing modules as they load where `opentelemetry` is not installed: its import fails."""
    for name in [n for n in sys.modules if n == "opentelemetry" or n.startswith("opentelemetry.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    importlib.reload(recovery.observe.tracing)
    importlib.reload(chat.turn.tracing)
    assert recovery.observe.tracing.trace is None
    yield
    monkeypatch.undo()
    importlib.reload(recovery.observe.tracing)
    importlib.reload(chat.turn.tracing)
    assert recovery.observe.tracing.trace is not None


def named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id


def new_agent(agent: str = "assistant") -> Any:
    return open_agent(agent, f"t-{uuid.uuid4().hex[:10]}", owner=TEST_PRINCIPAL)


async def test_a_turn_has_one_span_and_one_per_model_step_none_per_chunk(
    exporter: InMemorySpanExporter,
) -> None:
    agent = await sync_to_async(new_agent)()
    result = await agent.achat(["count to 5"], timeout=30)
    assert result.status == "completed" and result.text == "1 2 3 4 5"

    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == ["think.step", "think.turn"], "five numbers, no span per chunk"
    [turn] = named(spans, "think.turn")
    [step] = named(spans, "think.step")
    fiber = await Fiber.objects.aget(request_id=result.request_id)
    attributes = turn.attributes or {}
    assert {k: attributes[k] for k in attributes if k != "think.turn.chunks"} == {
        "think.conversation.id": agent.conversation_id,
        "gen_ai.conversation.id": str(agent.conversation_id),
        "gen_ai.agent.name": "assistant",
        "think.request.id": result.request_id,
        "think.request.root_id": result.request_id,
        "think.fiber.id": str(fiber.pk),
        "think.turn.kind": "programmatic",
        "think.turn.continuation": False,
        "think.turn.outcome": "completed",
    }
    assert attributes["think.turn.chunks"] > 5
    assert turn.status.status_code == StatusCode.UNSET
    assert (parent_of(step), trace_id(step)) == (span_id(turn), trace_id(turn))
    step_attributes = dict(step.attributes or {})
    assert step_attributes.pop("gen_ai.usage.input_tokens") > 0
    assert step_attributes == {
        "gen_ai.operation.name": "chat",
        "think.step.number": 1,
        "gen_ai.request.model": "openai/scripted",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.output_tokens": 5,  # the scripted model counts one token per chunk
    }
    # The run's context is stored with its fiber: the spans of its recovery would continue it.
    traceparent = FiberSnapshot.from_json(fiber.snapshot).trace["traceparent"]
    assert traceparent.split("-")[1:3] == [f"{trace_id(turn):032x}", f"{span_id(turn):016x}"]


async def test_tool_calls_have_a_span_each_with_their_outcome(exporter: InMemorySpanExporter) -> None:
    agent = await sync_to_async(new_agent)("tool-agent")
    result = await agent.achat([f"{ADD} {EXPLODE}"], timeout=30)
    assert result.status == "completed"

    spans = exporter.get_finished_spans()
    [turn] = named(spans, "think.turn")
    steps = named(spans, "think.step")
    tools = {(s.attributes or {})["gen_ai.tool.name"]: s for s in named(spans, "think.tool")}
    assert [(s.attributes or {})["gen_ai.response.finish_reasons"] for s in steps] == [
        ("tool-calls",),
        ("stop",),
    ]
    assert set(tools) == {"add", "explode"}
    parts = {p["toolCallId"]: p for p in (result.message or {})["parts"] if "toolCallId" in p}
    for name, state in (("add", "output-available"), ("explode", "output-error")):
        attributes = tools[name].attributes or {}
        assert attributes["gen_ai.operation.name"] == "execute_tool"
        assert parts[str(attributes["gen_ai.tool.call.id"])]["state"] == state, "the call id of its part"
        assert parent_of(tools[name]) == span_id(turn)
    assert (tools["add"].attributes or {})["think.tool.outcome"] == "ok"
    assert tools["add"].status.status_code == StatusCode.UNSET
    assert (tools["explode"].attributes or {})["think.tool.outcome"] == "error"
    assert tools["explode"].status.status_code == StatusCode.ERROR
    assert tools["explode"].status.description == "RuntimeError: the tool exploded"
    # The step that asked for the tools ended before they ran; the next one started after.
    assert steps[0].end_time <= min(t.start_time for t in tools.values())
    assert max(t.end_time for t in tools.values()) <= steps[1].start_time


async def test_a_call_the_worker_does_not_run_has_a_span_saying_so(exporter: InMemorySpanExporter) -> None:
    agent = await sync_to_async(new_agent)("tool-agent")
    result = await agent.achat(['[tool delete_file {"tag": "trace"}]'], timeout=30)
    assert result.status == "completed"
    [tool] = named(exporter.get_finished_spans(), "think.tool")
    assert tool.attributes is not None
    assert (tool.attributes["gen_ai.tool.name"], tool.attributes["think.tool.outcome"]) == (
        "delete_file",
        "approval_requested",
    )


# -- a recovered turn ----------------------------------------------------------------------------------


@dataclass
class Recovered:
    interrupted: Fiber
    recovering: Fiber
    alarm_payload: dict[str, Any]
    runner: TurnRunner


async def recover(agent: Any, sent: dict[str, list[Any]]) -> Recovered:
    """A turn interrupted at "1 2 3" of six, recovered: the engine, its continue alarm, the continuation."""
    interrupted = await interrupted_turn(agent, "count to 6 [stall after 3]")
    await arecover_fiber(interrupted.pk)  # as think.recover_fiber runs it, outside the dead turn's context
    [alarm_id] = sent["alarms"]
    alarm = await Alarm.objects.aget(pk=alarm_id)
    assert alarm.callback == CONTINUE_CALLBACK
    await afire_alarm(alarm_id)
    [fiber_id] = sent["turns"]
    runner = await turn_run(str(fiber_id))
    assert runner is not None and runner.outcome == "completed"
    messages = await sync_to_async(agent.messages)()
    assert [p.get("text") for p in messages[-1]["parts"] if p["type"] == "text"] == ["1 2 3", " 4 5 6"]
    recovering = await Fiber.objects.aget(pk=fiber_id)
    return Recovered(interrupted, recovering, dict(alarm.payload), runner)


async def test_a_recovered_turn_is_in_the_trace_of_the_turn_it_recovers(
    exporter: InMemorySpanExporter, quiet_broker: dict[str, list[Any]]
) -> None:
    agent = await sync_to_async(new_agent)()
    recovered = await recover(agent, quiet_broker)

    spans = exporter.get_finished_spans()
    first, second = sorted(named(spans, "think.turn"), key=lambda s: s.start_time or 0)
    [attempt] = named(spans, "think.recovery.attempt")
    incident_id = recovered.alarm_payload["incidentId"]
    assert first.attributes is not None and second.attributes is not None and attempt.attributes is not None
    # The run that died: handed over by its worker's shutdown, its context stored with its fiber.
    assert (first.attributes["think.turn.outcome"], first.attributes["think.turn.stop_reason"]) == (
        "interrupted",
        "shutdown",
    )
    stored = await Fiber.objects.aget(pk=recovered.interrupted.pk)
    assert (
        FiberSnapshot.from_json(stored.snapshot).trace["traceparent"].split("-")[2]
        == f"{span_id(first):016x}"
    )
    # The recovery attempt: a child of that run, found through the fiber (no span was current here).
    assert (parent_of(attempt), trace_id(attempt)) == (span_id(first), trace_id(first))
    assert {k: attempt.attributes[k] for k in attempt.attributes} == {
        "think.fiber.id": str(recovered.interrupted.pk),
        "think.conversation.id": agent.conversation_id,
        "think.request.id": recovered.interrupted.request_id,
        "think.request.root_id": recovered.interrupted.request_id,
        "think.incident.id": incident_id,
        "think.recovery.attempt": 1,
        "think.recovery.max_attempts": 10,
        "think.recovery.kind": "continue",
        "think.recovery.outcome": "scheduled",
        "think.recovery.callback": CONTINUE_CALLBACK,
        "think.recovery.delay_ms": 0,
    }
    # The continuation, on another run: a child of the attempt, linked to the run it recovers.
    assert (parent_of(second), trace_id(second)) == (span_id(attempt), trace_id(first))
    [link] = second.links
    assert (link.context.trace_id, link.context.span_id) == (trace_id(first), span_id(first))
    assert link.attributes == {"think.link": "recovers"}
    assert second.attributes["think.turn.kind"] == "continue"
    assert second.attributes["think.request.id"] == recovered.recovering.request_id
    assert second.attributes["think.request.root_id"] == recovered.interrupted.request_id
    assert second.attributes["think.incident.id"] == incident_id
    assert second.attributes["think.turn.outcome"] == "completed"
    steps = named(spans, "think.step")
    assert {parent_of(s) for s in steps} == {span_id(first), span_id(second)}
    assert {trace_id(s) for s in spans} == {trace_id(first)}, "one trace holds all of it"


async def test_a_declined_recovery_attempt_says_so(
    exporter: InMemorySpanExporter, quiet_broker: dict[str, list[Any]]
) -> None:
    name = f"nocontinue-{uuid.uuid4().hex[:8]}"
    agent = await sync_to_async(open_agent)("recovery-probe", name, owner=TEST_PRINCIPAL)
    interrupted = await interrupted_turn(agent, "count to 6 [stall after 3]")
    await arecover_fiber(interrupted.pk)
    assert quiet_broker["alarms"] == []
    [attempt] = named(exporter.get_finished_spans(), "think.recovery.attempt")
    assert attempt.attributes is not None
    assert (attempt.attributes["think.recovery.outcome"], attempt.attributes["think.recovery.reason"]) == (
        "skipped",
        "continue_disabled",
    )
    assert attempt.attributes["think.incident.id"]


@pytest.mark.usefixtures("without_opentelemetry")
async def test_without_opentelemetry_turns_tools_and_recovery_run_and_store_no_trace(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = await sync_to_async(new_agent)("tool-agent")
    result = await agent.achat([ADD], timeout=30)
    assert (result.status, result.text) == ("completed", "Tool add returned: 3")
    fiber = await Fiber.objects.aget(request_id=result.request_id)
    assert TRACE_SLOT not in fiber.snapshot

    recovered = await recover(await sync_to_async(new_agent)(), quiet_broker)
    assert "trace" not in recovered.alarm_payload
    assert FiberSnapshot.from_json(recovered.recovering.snapshot).turn.recovery_trace is None
