"""What an app adds to the recovery layer at start-up (recovery.engine.alarms.register_callback,
recovery.engine.detection.register_tick_sweep): the alarm table and the beat tick name no app's work."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from chat.transcript import submissions
from recovery.engine import alarms, detection
from recovery.engine.alarms import (
    afire_alarm,
    alarm_claim,
    alarm_schedule,
    register_callback,
    registered_callback,
)
from recovery.engine.detection import register_tick_sweep
from recovery.models import Alarm
from recovery.process.runtime import db
from recovery.tasks import recovery_tick
from tests.operator_support import make_conversation, terminate_new_backends


@pytest.fixture(scope="module", autouse=True)
def close_db_thread_connections(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    yield from terminate_new_backends(django_db_blocker)


@pytest.fixture
def restore_registries() -> Iterator[None]:
    callbacks, sweeps = dict(alarms._callbacks), dict(detection._sweeps)
    yield
    alarms._callbacks.clear()
    alarms._callbacks.update(callbacks)
    detection._sweeps.clear()
    detection._sweeps.update(sweeps)


def test_the_chat_app_registers_its_drain_alarm_and_its_sweep_at_start_up() -> None:
    assert registered_callback(submissions.DRAIN_CALLBACK) is submissions.drain_alarm
    assert detection._sweeps["submissions"] is submissions.submissions_sweep


@pytest.mark.django_db(transaction=True)
async def test_an_alarm_runs_the_callback_registered_under_its_name(restore_registries: None) -> None:
    ran: list[tuple[int, dict[str, Any]]] = []

    async def remember(conversation: Any, payload: dict[str, Any]) -> None:
        ran.append((conversation.pk, payload))

    register_callback("test_remember", remember)

    def due_alarm() -> tuple[int, int]:
        conversation = make_conversation()
        alarm = alarm_schedule(
            conversation_id=conversation.pk, callback="test_remember", payload={"n": 1}, idempotent=False
        )
        assert alarm_claim(alarm_id=alarm.pk)
        return conversation.pk, alarm.pk

    conversation_id, alarm_id = await db(due_alarm)
    await afire_alarm(alarm_id)
    assert ran == [(conversation_id, {"n": 1})]
    assert not await db(Alarm.objects.filter(pk=alarm_id).exists), "done: the row is gone"


@pytest.mark.django_db(transaction=True)
async def test_an_alarm_whose_name_nobody_registered_is_dropped_with_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def due_alarm() -> int:
        alarm = alarm_schedule(
            conversation_id=make_conversation().pk, callback="nobody_knows", payload={}, idempotent=False
        )
        assert alarm_claim(alarm_id=alarm.pk)
        return alarm.pk

    alarm_id = await db(due_alarm)
    with caplog.at_level(logging.ERROR, logger="recovery.engine.alarms"):
        await afire_alarm(alarm_id)
    assert "unknown callback 'nobody_knows'" in caplog.text
    assert not await db(Alarm.objects.filter(pk=alarm_id).exists), "done: the row is gone"


@pytest.mark.django_db
def test_the_tick_runs_every_registered_sweep_and_a_failing_one_stops_nothing(
    restore_registries: None, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> int:
        raise RuntimeError("sweep broke")

    register_tick_sweep("counted", lambda: 3)
    register_tick_sweep("broken", broken)
    with caplog.at_level(logging.ERROR, logger="recovery.engine.detection"):
        result = recovery_tick()
    assert result["counted"] == 3 and result["broken"] == 0
    assert "submissions" in result and "fibers" in result
    assert "broken sweep failed" in caplog.text


def test_the_chat_app_registers_its_recovery_target_and_alarms() -> None:
    from chat.tasks import run_turn
    from chat.turn import continuation as recovery_alarms
    from chat.turn.interrupted import CONTINUE_CALLBACK, RETRY_CALLBACK, ChatTarget
    from recovery.engine.targets import recovery_target

    assert isinstance(recovery_target(), ChatTarget)
    assert recovery_target().task_name == run_turn.name == "think.run_turn"
    assert registered_callback(CONTINUE_CALLBACK) is recovery_alarms.continue_alarm
    assert registered_callback(RETRY_CALLBACK) is recovery_alarms.retry_alarm


def test_without_a_registered_target_the_engine_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from django.core.exceptions import ImproperlyConfigured

    import recovery.engine.targets

    monkeypatch.setattr(recovery.engine.targets, "_target", None)
    with pytest.raises(ImproperlyConfigured, match="no app registered a recovery target"):
        recovery.engine.targets.recovery_target()
