"""Diagnostic channels: events routed by type prefix to five channels.

    from recovery.observe import diagnostics
    unsubscribe = diagnostics.subscribe("chat", lambda event: print(event["type"]))

The channels are `chat`, `transcript`, `fiber`, `submission` and `schedule`. Routing, first match wins:

- `fiber:*` and `agent_tool:*` (sub-agent runs are fibers) -> `fiber`
- `transcript:*` and `chat:transcript:*` -> `transcript`
- `submission:*` -> `submission`
- `schedule:*`, `queue:*` and `alarm:*` (alarms are the durable schedule here) -> `schedule`
- everything else -> `chat`: every other `chat:*` event, the reference's `message:`, `tool:`, `action:`,
  `channel:` and `notice:` events, and any type not listed above. The reference's `message` and
  `lifecycle` channels are folded into `chat`, the agent's own channel.

An event is the envelope `{type, agent, name, payload, timestamp}` (`timestamp` in epoch milliseconds).
Each one goes to the channel's Python subscribers, then to its Django signal (`recovery.signals`), both
called synchronously in the process that emits (the worker, for most events), their errors logged and
never raised; then it is one structured log line on the `think.events` logger, whose `extra` holds the
event type, the channel, the conversation (`agent/name`) and the ids the payload carries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from recovery.signals import SIGNALS

logger = logging.getLogger("think.events")

CHANNELS = ("chat", "transcript", "fiber", "submission", "schedule")
DEFAULT_CHANNEL = "chat"
_ROUTES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("fiber:", "agent_tool:"), "fiber"),
    (("transcript:", "chat:transcript:"), "transcript"),
    (("submission:",), "submission"),
    (("schedule:", "queue:", "alarm:"), "schedule"),
)

Event = dict[str, Any]
Subscriber = Callable[[Event], None]

_lock = threading.Lock()
_subscribers: dict[str, list[Subscriber]] = {channel: [] for channel in CHANNELS}


def channel_for(event_type: str) -> str:
    """The channel of an event type, by prefix (see the module docstring)."""
    for prefixes, channel in _ROUTES:
        if event_type.startswith(prefixes):
            return channel
    return DEFAULT_CHANNEL


def subscribe(channel: str, callback: Subscriber) -> Callable[[], None]:
    """Call `callback(event)` for every event of a channel; returns a function that unsubscribes."""
    if channel not in _subscribers:
        raise ValueError(f"unknown diagnostic channel {channel!r}; expected one of {', '.join(CHANNELS)}")
    with _lock:
        _subscribers[channel].append(callback)

    def unsubscribe() -> None:
        with _lock:
            if callback in _subscribers[channel]:
                _subscribers[channel].remove(callback)

    return unsubscribe


def emit(event_type: str, payload: dict[str, Any], *, agent: str = "", name: str = "") -> Event:
    """Publish one event: subscribers, then the channel's signal, then the log line."""
    event: Event = {
        "type": event_type,
        "agent": agent,
        "name": name,
        "payload": payload,
        "timestamp": int(time.time() * 1000),
    }
    channel = channel_for(event_type)
    with _lock:
        subscribers = list(_subscribers[channel])
    for callback in subscribers:
        try:
            callback(event)
        except Exception:
            logger.exception("diagnostics subscriber failed for %s", event_type)
    try:
        # send_robust logs (on `django.dispatch`) and returns what a receiver raises.
        SIGNALS[channel].send_robust(sender=None, **event)
    except Exception:  # e.g. an async receiver connected while the event comes from an event loop
        logger.exception("diagnostics signal failed for %s", event_type)
    extra = log_fields(event, channel)
    summary = " ".join(f"{key}={extra[key]}" for key in _SUMMARY_KEYS if key in extra)
    logger.info("%s %s", event_type, summary, extra=extra)
    return event


# Payload keys worth a structured field (camelCase as in the event payloads; the exhausted context
# is snake_case).
_ID_FIELDS = {
    "requestId": "request_id",
    "request_id": "request_id",
    "incidentId": "incident_id",
    "incident_id": "incident_id",
    "recoveryRootRequestId": "recovery_root_request_id",
    "recovery_root_request_id": "recovery_root_request_id",
    "fiberId": "fiber_id",
    "submissionId": "submission_id",
    "reason": "reason",
    "attempt": "attempt",
    "status": "status",
}
_SUMMARY_KEYS = ("conversation", *dict.fromkeys(_ID_FIELDS.values()))


def log_fields(event: Event, channel: str) -> dict[str, Any]:
    """The `extra` of an event's log line: type, channel, conversation and the payload's ids."""
    fields: dict[str, Any] = {"event": event["type"], "channel": channel, "agent": event["agent"]}
    if event["name"]:
        fields["conversation"] = f"{event['agent']}/{event['name']}"
    payload = event["payload"]
    for key, field in _ID_FIELDS.items():
        if payload.get(key) is not None:
            fields[field] = payload[key]
    return fields
