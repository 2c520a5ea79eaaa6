"""The cancel signal (recovery.lease.control): a cancel committed in Postgres reaches a listening process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from recovery.checks import check_recovery_settings
from recovery.lease import control
from recovery.lease.fibers import fiber_claim, fiber_request_cancel
from tests.recovery.test_engine_store import make_conversation, make_fiber


@pytest.fixture
def listening() -> Iterator[None]:
    control.start()
    assert control.listening.wait(10), "the listener did not get its session"
    yield
    control.stop()
    control.listening.clear()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("listening")
def test_a_committed_cancel_reaches_the_watcher_of_its_fiber_and_no_other() -> None:
    conversation = make_conversation()
    mine, other = make_fiber(conversation), make_fiber(make_conversation())
    for fiber in (mine, other):  # both running, in two conversations
        assert fiber_claim(fiber_id=fiber.pk, owner="test") is not None
    heard: dict[str, threading.Event] = {str(mine.pk): threading.Event(), str(other.pk): threading.Event()}
    for fiber_id, event in heard.items():
        control.watch(fiber_id, event.set)
    try:
        assert fiber_request_cancel(conversation_id=conversation.pk, request_id=mine.request_id)
        assert heard[str(mine.pk)].wait(5), "the cancel signal did not arrive"
        assert not heard[str(other.pk)].wait(0.3), "a cancel reaches only the watchers of its fiber"
    finally:
        for fiber_id in heard:
            control.unwatch(fiber_id)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("listening")
def test_a_cancel_that_finds_nothing_running_sends_no_signal() -> None:
    conversation = make_conversation()
    pending = make_fiber(conversation)  # never claimed: cancelled at once, no worker to tell
    heard = threading.Event()
    control.watch(pending.pk, heard.set)
    try:
        assert not fiber_request_cancel(conversation_id=conversation.pk, request_id=pending.request_id)
        assert not heard.wait(0.3)
    finally:
        control.unwatch(pending.pk)


def test_signals_can_be_turned_off(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "CANCEL_SIGNALS": False}
    control.start()
    assert control._listener is None and not control.listening.is_set()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_cancel_signals_must_be_a_boolean(settings: Any, value: Any) -> None:
    settings.THINK = {**settings.THINK, "CANCEL_SIGNALS": value}
    assert [m.id for m in check_recovery_settings()] == ["think_recovery.E003"]
