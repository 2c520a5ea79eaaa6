"""A submission whose worker is killed mid-turn is continued by recovery and completes."""

from __future__ import annotations

import signal
import uuid
from typing import Any

import pytest

from chat.agents import open_agent
from chat.transcript.snapshot import FiberSnapshot, TurnKind
from recovery.models import Fiber
from tests.support import TEST_PRINCIPAL, assistant_text, numbers, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def own_workers(recovery_stack: Any) -> Any:
    yield
    recovery_stack.stop_workers()


def test_an_in_flight_submission_is_continued_to_completion(
    recovery_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This process would hand the drain to the default queue, where the shared stack's worker (not the
    # one this test kills) would run the turn: leave the drain to the recovery stack's sweep instead.
    from recovery.process import dispatch

    monkeypatch.setattr(dispatch, "fire_later", lambda alarm_id: None)
    worker = recovery_stack.start_worker()
    agent = open_agent("assistant", f"sr-{uuid.uuid4().hex[:8]}", owner=TEST_PRINCIPAL)
    result = agent.submit_messages(["count to 200 [rate 25]"])

    def streaming() -> bool:
        text = assistant_text(agent.messages())
        fiber = Fiber.objects.filter(request_id=result.request_id).first()
        return fiber is not None and fiber.status == "running" and not text and fiber.streams.exists()

    wait_until(streaming, 20, "the submission's turn to stream")
    wait_until(
        lambda: Fiber.objects.get(request_id=result.request_id).streams.get().segments.count() >= 2,
        20,
        "chunks",
    )
    worker.kill(signal.SIGKILL)
    assert agent.get_submission(result.submission_id).status == "running"
    recovery_stack.start_worker()

    def ended() -> bool:
        return agent.get_submission(result.submission_id).status not in ("pending", "running")

    wait_until(ended, 60, "the submission to end")
    row = agent.get_submission(result.submission_id)
    assert (row.status, row.error) == ("completed", "")
    chain = Fiber.objects.filter(conversation_id=agent.conversation_id).order_by("created_at")
    assert [f.kind for f in chain][:2] == [TurnKind.PROGRAMMATIC, TurnKind.CONTINUE]
    assert all(
        FiberSnapshot.from_json(f.snapshot).turn.recovery_root_request_id == result.request_id for f in chain
    )
    assert assistant_text(agent.messages()) == numbers(200)
