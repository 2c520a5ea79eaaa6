"""Diagnostic channels: routing by type prefix (reference §14), subscribers, log lines."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from recovery import diagnostics


@pytest.mark.parametrize(
    ("event_type", "channel"),
    [
        ("fiber:run:started", "fiber"),
        ("fiber:recovery:detected", "fiber"),
        ("chat:transcript:repaired", "transcript"),
        ("transcript:anything", "transcript"),
        ("chat:recovery:exhausted", "chat"),
        ("chat:stream:stalled", "chat"),
        ("chat:context:compacted", "chat"),
        ("submission:status", "message"),
        ("tool:call", "message"),
        ("message:error", "message"),
        ("schedule:execute", "schedule"),
        ("queue:drain", "schedule"),
        ("alarm:memory_limit_reset", "lifecycle"),
        ("something:else", "lifecycle"),
    ],
)
def test_events_are_routed_by_prefix(event_type: str, channel: str) -> None:
    assert diagnostics.channel_for(event_type) == channel


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


def test_a_failing_subscriber_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    def broken(event: dict[str, Any]) -> None:
        raise RuntimeError("subscriber bug")

    undo = [
        diagnostics.subscribe("schedule", broken),
        diagnostics.subscribe("schedule", lambda e: seen.append(e["type"])),
    ]
    try:
        with caplog.at_level(logging.INFO, logger="think.events"):
            diagnostics.emit("schedule:execute", {"callback": "chat_recovery_continue"})
    finally:
        for unsubscribe in undo:
            unsubscribe()
    assert seen == ["schedule:execute"]
    assert any("subscriber failed" in r.getMessage() for r in caplog.records)


def test_every_event_is_one_structured_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="think.events"):
        diagnostics.emit(
            "chat:recovery:exhausted",
            {"incidentId": "r:u", "requestId": "r", "reason": "stable_timeout"},
            agent="assistant",
            name="room",
        )
    (record,) = [r for r in caplog.records if r.name == "think.events"]
    assert record.event == "chat:recovery:exhausted"  # type: ignore[attr-defined]
    assert record.channel == "chat" and record.conversation == "room"  # type: ignore[attr-defined]
    assert record.incidentId == "r:u" and record.reason == "stable_timeout"  # type: ignore[attr-defined]


def test_unknown_channel_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown diagnostic channel"):
        diagnostics.subscribe("nope", lambda e: None)
