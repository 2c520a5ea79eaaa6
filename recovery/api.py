"""The recovery app's public face: what a host site imports from it.

    from recovery.api import beat_schedule   # in settings: the alarms' beat entries
    from recovery.api import subscribe, chat_event

Each name is imported from its module when it is first used, so `beat_schedule` can be read in
settings, before Django's apps are ready. The budget and the hook contexts an agent uses are on
chat.api. A name not listed here is internal and may move without notice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recovery.process.faces import lazy_face

# name -> the module that defines it
_FACE = {
    "beat_schedule": "recovery.engine.schedules",
    "subscribe": "recovery.observe.diagnostics",
    "emit": "recovery.observe.diagnostics",
    "chat_event": "recovery.signals",
    "transcript_event": "recovery.signals",
    "fiber_event": "recovery.signals",
    "submission_event": "recovery.signals",
    "schedule_event": "recovery.signals",
}

__all__ = sorted(_FACE)


__getattr__, __dir__ = lazy_face(__name__, _FACE)

if TYPE_CHECKING:  # what a type checker knows of the names above (tests/test_faces.py)
    from recovery.engine.schedules import beat_schedule as beat_schedule
    from recovery.observe.diagnostics import emit as emit
    from recovery.observe.diagnostics import subscribe as subscribe
    from recovery.signals import chat_event as chat_event
    from recovery.signals import fiber_event as fiber_event
    from recovery.signals import schedule_event as schedule_event
    from recovery.signals import submission_event as submission_event
    from recovery.signals import transcript_event as transcript_event
