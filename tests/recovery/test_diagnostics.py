"""Diagnostic channels: routing to the five channels, subscribers, signals, log lines."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.dispatch import Signal

from recovery import signals
from recovery.observe import diagnostics


@pytest.mark.parametrize(
    ("event_type", "channel"),
    [
        ("fiber:run:started", "fiber"),
        ("fiber:recovery:detected", "fiber"),
        ("agent_tool:recovery:begin", "fiber"),
        ("chat:transcript:repaired", "transcript"),
        ("transcript:anything", "transcript"),
        ("submission:create", "submission"),
        ("submission:status", "submission"),
        ("submission:error", "submission"),
        ("schedule:execute", "schedule"),
        ("queue:drain", "schedule"),
        ("alarm:memory_limit_reset", "schedule"),
        ("chat:recovery:exhausted", "chat"),
        ("chat:stream:stalled", "chat"),
        ("chat:context:compacted", "chat"),
        ("chat:turn:finish", "chat"),
        ("message:error", "chat"),
        ("tool:call", "chat"),
        ("action:run", "chat"),
        ("something:else", "chat"),
    ],
)
def test_events_are_routed_by_prefix(event_type: str, channel: str) -> None:
    assert diagnostics.channel_for(event_type) == channel


def test_the_channels_are_exactly_the_five_of_the_spec_each_with_its_signal() -> None:
    assert diagnostics.CHANNELS == ("chat", "transcript", "fiber", "submission", "schedule")
    assert set(signals.SIGNALS) == set(diagnostics.CHANNELS)
    assert signals.SIGNALS["chat"] is signals.chat_event
    assert signals.SIGNALS["submission"] is signals.submission_event


def test_subscribers_get_the_envelope_until_they_unsubscribe() -> None:
    seen: list[dict[str, Any]] = []
    unsubscribe = diagnostics.subscribe("chat", seen.append)
    try:
        diagnostics.emit(
            "chat:recovery:attempt", {"incidentId": "r:u", "attempt": 2}, agent="assistant", name="c1"
        )
        diagnostics.emit("fiber:run:started", {"fiberId": "f"})  # another channel
    finally:
        unsubscribe()
    diagnostics.emit("chat:recovery:attempt", {"incidentId": "r:u", "attempt": 3})
    assert len(seen) == 1
    event = seen[0]
    assert {k: event[k] for k in ("type", "agent", "name", "payload")} == {
        "type": "chat:recovery:attempt",
        "agent": "assistant",
        "name": "c1",
        "payload": {"incidentId": "r:u", "attempt": 2},
    }
    assert isinstance(event["timestamp"], int) and event["timestamp"] > 0


def test_submission_events_reach_submission_subscribers() -> None:
    seen: list[str] = []
    unsubscribe = diagnostics.subscribe("submission", lambda event: seen.append(event["type"]))
    try:
        diagnostics.emit("submission:status", {"submissionId": "s-1", "status": "running"})
    finally:
        unsubscribe()
    assert seen == ["submission:status"]


class Receiver:
    """A signal receiver that records the keyword arguments it was sent."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, sender: Any, **kwargs: Any) -> None:
        self.calls.append({"sender": sender, **kwargs})


@pytest.fixture
def connect() -> Iterator[Any]:
    connected: list[tuple[Signal, Any]] = []

    def _connect(signal: Signal, receiver: Any) -> Any:
        signal.connect(receiver, weak=False)
        connected.append((signal, receiver))
        return receiver

    yield _connect
    for signal, receiver in connected:
        signal.disconnect(receiver)


@pytest.mark.parametrize(
    ("signal", "event_type"),
    [
        (signals.chat_event, "chat:recovery:scheduled"),
        (signals.transcript_event, "chat:transcript:repaired"),
        (signals.fiber_event, "fiber:run:interrupted"),
        (signals.submission_event, "submission:create"),
        (signals.schedule_event, "schedule:execute"),
    ],
)
def test_each_channel_sends_its_signal_with_the_envelope_as_kwargs(
    connect: Any, signal: Signal, event_type: str
) -> None:
    receiver = connect(signal, Receiver())
    others = [connect(other, Receiver()) for other in signals.SIGNALS.values() if other is not signal]

    event = diagnostics.emit(event_type, {"requestId": "r-1"}, agent="assistant", name="room")

    (call,) = receiver.calls
    assert call.pop("signal") is signal  # Django adds the signal itself
    assert call == {"sender": None, **event}
    assert set(call) == {"sender", "type", "agent", "name", "payload", "timestamp"}
    assert all(other.calls == [] for other in others)


def test_failing_subscribers_and_receivers_are_logged_and_do_not_stop_the_others(
    connect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("observer bug")

    connect(signals.schedule_event, broken)
    receiver = connect(signals.schedule_event, Receiver())
    undo = [
        diagnostics.subscribe("schedule", broken),
        diagnostics.subscribe("schedule", lambda e: seen.append(e["type"])),
    ]
    try:
        with caplog.at_level(logging.INFO):
            event = diagnostics.emit("schedule:execute", {"callback": "chat_recovery_continue"})
    finally:
        for unsubscribe in undo:
            unsubscribe()
    assert seen == ["schedule:execute"] and len(receiver.calls) == 1
    assert event["type"] == "schedule:execute"
    assert any("subscriber failed" in r.getMessage() for r in caplog.records)
    assert any(r.name == "django.dispatch" and r.exc_info for r in caplog.records)  # the receiver's error
    assert [r for r in caplog.records if r.name == "think.events" and r.levelno == logging.INFO]


async def test_an_async_receiver_cannot_break_an_event_emitted_on_an_event_loop(
    connect: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def async_receiver(sender: Any, **kwargs: Any) -> None:
        await asyncio.sleep(0)

    connect(signals.fiber_event, async_receiver)
    with caplog.at_level(logging.INFO, logger="think.events"):
        diagnostics.emit("fiber:run:started", {"fiberId": "f-1"})  # must not raise
    assert any("signal failed for fiber:run:started" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith("fiber:run:started") for r in caplog.records)  # still logged


def _event_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "think.events" and r.levelno == logging.INFO]


def test_every_event_is_one_structured_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="think.events"):
        diagnostics.emit(
            "chat:recovery:failed",
            {"incidentId": "r:u", "requestId": "r", "reason": "recovered turn error", "attempt": 2},
            agent="assistant",
            name="room",
        )
    (record,) = _event_records(caplog)
    fields = vars(record)
    assert {key: fields[key] for key in ("event", "channel", "agent", "conversation")} == {
        "event": "chat:recovery:failed",
        "channel": "chat",
        "agent": "assistant",
        "conversation": "assistant/room",
    }
    assert (fields["request_id"], fields["incident_id"], fields["attempt"]) == ("r", "r:u", 2)
    assert fields["reason"] == "recovered turn error"
    assert "conversation=assistant/room" in record.getMessage() and "incident_id=r:u" in record.getMessage()


def test_the_exhausted_context_payload_is_logged_with_the_same_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    payload = {"incident_id": "r:u", "request_id": "r", "recovery_root_request_id": "r0", "reason": "x"}
    with caplog.at_level(logging.INFO, logger="think.events"):
        diagnostics.emit("chat:recovery:exhausted", payload, agent="assistant", name="room")
    (record,) = _event_records(caplog)
    fields = vars(record)
    assert (fields["incident_id"], fields["request_id"], fields["recovery_root_request_id"]) == (
        "r:u",
        "r",
        "r0",
    )


def test_fields_the_event_does_not_have_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="think.events"):
        diagnostics.emit("submission:create", {"submissionId": "s-1", "requestId": None})
    (record,) = _event_records(caplog)
    fields = vars(record)
    assert fields["channel"] == "submission" and fields["submission_id"] == "s-1"
    assert "conversation" not in fields and "request_id" not in fields and "incident_id" not in fields


def test_unknown_channel_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown diagnostic channel"):
        diagnostics.subscribe("message", lambda e: None)
