"""Diagnostic channels (reference §14): events routed by type prefix, Python subscribers, log lines.

    from recovery import diagnostics
    unsubscribe = diagnostics.subscribe("chat", lambda event: print(event["type"]))

Subscribers run in the process that emits (the worker, for most recovery events); every event is
also one structured log line on the `think.events` logger, with its ids as `extra` fields.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("think.events")

CHANNELS = ("chat", "transcript", "fiber", "message", "schedule", "lifecycle")
Event = dict[str, Any]
Subscriber = Callable[[Event], None]

_lock = threading.Lock()
_subscribers: dict[str, list[Subscriber]] = {channel: [] for channel in CHANNELS}


def channel_for(event_type: str) -> str:
    """The channel of an event type, by prefix (reference §14 routing)."""
    if event_type.startswith("fiber:"):
        return "fiber"
    if event_type.startswith(("transcript:", "chat:transcript:")):
        return "transcript"
    if event_type.startswith("chat:"):
        return "chat"
    if event_type.startswith(("message:", "tool:", "submission:", "action:")):
        return "message"
    if event_type.startswith(("schedule:", "queue:")):
        return "schedule"
    return "lifecycle"


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
    """Publish one event: subscribers first (their errors are logged, never raised), then the log line."""
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
    extra = {
        "event": event_type,
        "channel": channel,
        "agent": agent,
        "conversation": name,
        **{key: value for key, value in payload.items() if key in _ID_KEYS},
    }
    logger.info("%s %s", event_type, _summary(payload), extra=extra)
    return event


_ID_KEYS = (
    "incidentId",
    "requestId",
    "recoveryRootRequestId",
    "fiberId",
    "submissionId",
    "reason",
    "attempt",
)


def _summary(payload: dict[str, Any]) -> str:
    return " ".join(f"{key}={payload[key]}" for key in _ID_KEYS if key in payload)
