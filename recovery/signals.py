"""Django signals of the diagnostic channels: one per channel, sent for every event of that channel.

    from django.dispatch import receiver
    from recovery.signals import chat_event

    @receiver(chat_event)
    def on_chat_event(sender, *, type, agent, name, payload, timestamp, **kwargs):
        ...

The keyword arguments are the event envelope: `type`, `agent`, `name`, `payload` and
`timestamp` (epoch milliseconds); `sender` is None. Receivers are called synchronously in the process
and thread that emits the event (often the worker's event loop), so connect quick, synchronous
functions. Their errors are logged, never raised.
"""

from __future__ import annotations

from django.dispatch import Signal

chat_event = Signal()
transcript_event = Signal()
fiber_event = Signal()
submission_event = Signal()
schedule_event = Signal()

SIGNALS: dict[str, Signal] = {
    "chat": chat_event,
    "transcript": transcript_event,
    "fiber": fiber_event,
    "submission": submission_event,
    "schedule": schedule_event,
}
