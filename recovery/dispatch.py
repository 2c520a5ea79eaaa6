"""How the recovery layer sends a pending fiber's work to a worker: the app that owns the fibers
registers its dispatcher in AppConfig.ready() (the chat app: its turn task), so detection names no
app's task."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class Dispatcher:
    task_name: str  # the Celery task that runs the fibers: the tick reads the length of its queue
    enqueue_next: Callable[[int], None]  # send the head pending fiber of a conversation (again)


_dispatcher: Dispatcher | None = None


def register_dispatcher(dispatcher: Dispatcher) -> None:
    global _dispatcher
    _dispatcher = dispatcher


def dispatcher() -> Dispatcher:
    if _dispatcher is None:
        raise ImproperlyConfigured("no app registered a recovery dispatcher (is the chat app installed?)")
    return _dispatcher
