"""A pending fiber whose task was lost is sent again (recovery.engine.detection.fibers_requeue_stale): soon
while the turn queue is empty (a worker took the task and died before claiming the fiber), only after
the long wait while turns queue up (its task may be one of them)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from kombu import Queue

import recovery.engine.detection
from chat.models import Conversation
from recovery.engine.detection import REQUEUE_AFTER, REQUEUE_IDLE_AFTER, fibers_requeue_stale, turn_queue_size
from recovery.models import Fiber
from tests.operator_support import make_conversation, make_fiber

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fibers whose turn task was sent (chat.transcript.turns.turn_send)."""
    import chat.transcript.turns

    calls: list[str] = []
    monkeypatch.setattr(chat.transcript.turns, "turn_send", lambda fiber_id: calls.append(str(fiber_id)))
    return calls


def pending_since(conversation: Conversation, age: timedelta) -> Fiber:
    fiber = make_fiber(conversation, Fiber.Status.PENDING)
    Fiber.objects.filter(pk=fiber.pk).update(created_at=timezone.now() - age)
    return fiber


def queued(monkeypatch: pytest.MonkeyPatch, size: int | None) -> None:
    monkeypatch.setattr(recovery.engine.detection, "turn_queue_size", lambda: size)


def test_with_the_turn_queue_empty_a_lost_task_is_sent_again_within_seconds(
    sent: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    queued(monkeypatch, 0)
    fiber = pending_since(make_conversation(), REQUEUE_IDLE_AFTER + timedelta(seconds=1))
    young = pending_since(make_conversation(), timedelta(0))
    assert fibers_requeue_stale() == 1
    assert sent == [str(fiber.pk)], "a fiber just created is not sent twice"
    assert fibers_requeue_stale() == 0, "once per wait"
    Fiber.objects.filter(pk=fiber.pk).update(heartbeat_at=timezone.now() - REQUEUE_IDLE_AFTER * 2)
    assert fibers_requeue_stale() == 1 and sent == [str(fiber.pk)] * 2
    assert young.pk not in sent


@pytest.mark.parametrize("size", [3, None], ids=["turns-queued", "queue-unknown"])
def test_while_turns_queue_up_or_the_queue_is_unknown_only_the_long_wait_applies(
    sent: list[str], monkeypatch: pytest.MonkeyPatch, size: int | None
) -> None:
    queued(monkeypatch, size)
    pending_since(make_conversation(), REQUEUE_IDLE_AFTER + timedelta(seconds=1))
    old = pending_since(make_conversation(), REQUEUE_AFTER + timedelta(seconds=1))
    assert fibers_requeue_stale() == 1
    assert sent == [str(old.pk)]


def test_a_fiber_queued_behind_a_running_turn_is_not_sent(
    sent: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    queued(monkeypatch, 0)
    conversation = make_conversation()
    make_fiber(conversation, Fiber.Status.RUNNING)
    pending_since(conversation, REQUEUE_AFTER + timedelta(seconds=1))
    fibers_requeue_stale()
    assert sent == []


def test_the_turn_queue_is_read_from_the_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import current_app

    from chat.tasks import run_turn

    queue = Queue(f"think-requeue-{uuid.uuid4().hex[:8]}")
    router: Any = current_app.amqp.router
    monkeypatch.setattr(router, "route", lambda options, name, *args, **kwargs: {"queue": queue})
    assert turn_queue_size() == 0, "a queue nobody declared holds nothing"
    try:
        run_turn.apply_async(args=[str(uuid.uuid4())], queue=queue.name)
        run_turn.apply_async(args=[str(uuid.uuid4())], queue=queue.name)
        assert turn_queue_size() == 2
    finally:
        with current_app.connection_for_write() as connection:
            connection.default_channel.queue_delete(queue.name)
