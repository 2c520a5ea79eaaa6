"""The answer reaches whoever asked: `turn_completed` and `on_turn_completed`, once per turn, after the
commit that ended it, with the final message and how the turn ended.

Turns run in the test process through the real path (tests/inprocess.py); the agent's hook records into
Redis (tests.agents.CompletionProbe), a receiver of the signal into a list here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import transaction

from chat.agents import open_agent
from chat.models import TurnCompletion
from chat.signals import turn_completed
from chat.transcript.completions import completion_record, completions_due
from chat.transcript.turns import turn_cancel, turn_start_programmatic
from chat.turn import deliveries
from chat.turn.actions import astop_conversation
from chat.turn.continuation import give_up_now
from chat.turn.registry import agent_class
from chat.turn.runner import turn_run
from recovery.engine.spine import arecover_fiber
from recovery.models import Fiber, Incident
from recovery.process.runtime import db
from tests.agents import completions_seen
from tests.inprocess import interrupted_turn, recovered_run
from tests.support import TEST_PRINCIPAL, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("in_process_model")]

AGENT = "completion-probe"


@pytest.fixture
def received() -> Iterator[list[dict[str, Any]]]:
    """What the signal's receivers got: (sender, result) as a dict."""
    got: list[dict[str, Any]] = []

    def receiver(sender: Any, *, result: Any, **kwargs: Any) -> None:
        got.append({"sender": sender, "result": result})

    turn_completed.connect(receiver, weak=False)
    yield got
    turn_completed.disconnect(receiver)


def new_agent() -> Any:
    return open_agent(AGENT, f"done-{uuid.uuid4().hex[:8]}", owner=TEST_PRINCIPAL)


def delivered(name: str, count: int = 1, timeout: float = 10) -> list[dict[str, Any]]:
    """The hook's records once there are `count` of them (and a moment later, none more)."""
    wait_until(lambda: len(completions_seen(name)) >= count, timeout, f"{count} on_turn_completed call(s)")
    time.sleep(0.3)
    return completions_seen(name)


async def test_a_completed_turn_reaches_the_signal_and_the_hook_once(
    received: list[dict[str, Any]], quiet_broker: dict[str, list[Any]]
) -> None:
    agent = await sync_to_async(new_agent)()
    started = await db(
        turn_start_programmatic, conversation_id=agent.conversation_id, messages=["count to 3"], enqueue=False
    )
    fiber = await Fiber.objects.aget(conversation_id=agent.conversation_id, request_id=started.request_id)
    runner = await turn_run(str(fiber.pk))
    assert runner is not None and runner.outcome == "completed"

    [seen] = await asyncio.to_thread(delivered, agent.name)
    assert (seen["request_id"], seen["ending"], seen["text"]) == (started.request_id, "completed", "1 2 3")
    assert seen["message_id"] == (await sync_to_async(agent.messages)())[-1]["id"]
    [got] = received
    assert got["sender"].__name__ == "CompletionProbe" and got["result"].text == "1 2 3"
    row = await TurnCompletion.objects.aget(conversation_id=agent.conversation_id)
    assert row.delivered_at is not None and row.attempts == 1


async def test_a_recovered_turn_is_reported_once_under_its_own_request_id_with_the_whole_answer(
    received: list[dict[str, Any]], quiet_broker: dict[str, list[Any]]
) -> None:
    agent = await sync_to_async(new_agent)()
    interrupted = await interrupted_turn(agent, "count to 6 [stall after 3]")
    runner = await recovered_run(interrupted, quiet_broker)
    assert runner is not None and runner.outcome == "completed"

    [seen] = await asyncio.to_thread(delivered, agent.name)
    assert (seen["request_id"], seen["ending"]) == (interrupted.request_id, "recovered")
    assert seen["last_request_id"] != interrupted.request_id, "ended by the continuation"
    assert seen["text"] == "1 2 3 4 5 6"
    assert [r["result"].request_id for r in received] == [interrupted.request_id]


async def test_a_stop_reports_the_running_and_the_queued_turn_as_cancelled(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = await sync_to_async(new_agent)()
    interrupted = await interrupted_turn(agent, "count to 6 [stall after 3]")  # interrupted, not yet handled
    queued = await db(
        turn_start_programmatic, conversation_id=agent.conversation_id, messages=["next"], enqueue=False
    )
    await astop_conversation(agent.conversation_id)

    seen = {r["request_id"]: r for r in await asyncio.to_thread(delivered, agent.name, 2)}
    assert {k: v["ending"] for k, v in seen.items()} == {
        interrupted.request_id: "cancelled",
        queued.request_id: "cancelled",
    }
    assert seen[interrupted.request_id]["text"] == "1 2 3", "the answer it had streamed"
    assert seen[queued.request_id]["message_id"] is None


async def test_a_given_up_turn_is_reported_exhausted_with_the_terminal_message(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = await sync_to_async(new_agent)()
    interrupted = await interrupted_turn(agent, "count to 6 [stall after 3]")
    await arecover_fiber(interrupted.pk)
    incident = await Incident.objects.aget(conversation_id=agent.conversation_id)
    await asyncio.to_thread(give_up_now, incident, reason="forced")

    [seen] = await asyncio.to_thread(delivered, agent.name)
    assert (seen["request_id"], seen["ending"]) == (interrupted.request_id, "exhausted")
    assert "could not recover" in seen["error"]
    assert seen["text"] == "1 2 3"


def test_a_cancel_of_a_queued_turn_is_reported_once(quiet_broker: dict[str, list[Any]]) -> None:
    agent = new_agent()
    queued = turn_start_programmatic(conversation_id=agent.conversation_id, messages=["hi"], enqueue=False)
    assert turn_cancel(conversation_id=agent.conversation_id, request_id=queued.request_id) is False
    turn_cancel(conversation_id=agent.conversation_id, request_id=queued.request_id)  # twice: still one
    [seen] = delivered(agent.name)
    assert (seen["request_id"], seen["ending"]) == (queued.request_id, "cancelled")


def test_an_ending_its_process_never_delivered_is_delivered_by_the_sweep_once(
    monkeypatch: pytest.MonkeyPatch, received: list[dict[str, Any]]
) -> None:
    """The process died between its commit and the delivery: nothing was claimed; the tick's sweep
    delivers it once the grace period passed, and never again."""
    monkeypatch.setattr(deliveries, "deliver_soon", lambda ids: None)
    import chat.transcript.completions as completions

    monkeypatch.setattr(completions, "_listeners", [])  # the commit reaches nobody
    agent = new_agent()
    with transaction.atomic():
        assert completion_record(
            conversation_id=agent.conversation_id, request_id="orphan", ending="completed"
        )
        assert not completion_record(
            conversation_id=agent.conversation_id, request_id="orphan", ending="failed"
        )
    row = TurnCompletion.objects.get(conversation_id=agent.conversation_id, request_id="orphan")
    assert completions_due() == [], "not before the grace period"
    TurnCompletion.objects.filter(pk=row.pk).update(created_at=row.created_at.replace(year=2000))
    assert completions_due() == [row.pk]

    assert deliveries.completions_sweep() == 1
    assert deliveries.completions_sweep() == 0
    [seen] = delivered(agent.name)
    assert (seen["request_id"], seen["ending"]) == ("orphan", "completed"), "the first ending stands"
    assert [r["result"].request_id for r in received] == ["orphan"]


def test_two_deliverers_of_one_ending_deliver_it_once() -> None:
    agent = new_agent()
    with transaction.atomic():
        completion_record(conversation_id=agent.conversation_id, request_id="twice", ending="completed")
    pk = TurnCompletion.objects.get(request_id="twice", conversation_id=agent.conversation_id).pk

    async def both() -> list[bool]:
        return list(await asyncio.gather(deliveries.deliver(pk), deliveries.deliver(pk)))

    results = async_to_sync(both)()
    # The commit's own delivery may have won the race: at most one of these, and one call in all.
    assert results.count(True) <= 1
    assert len(delivered(agent.name)) == 1


async def test_a_turn_nobody_hears_of_costs_one_insert_and_no_delivery(
    quiet_broker: dict[str, list[Any]],
) -> None:
    """No turn_completed receiver and no on_turn_completed of the agent's own: the ending is recorded
    (the audit) as delivered in the finish's own statement, and nothing runs after the commit."""
    assert not turn_completed.has_listeners()
    agent = await sync_to_async(open_agent)(
        "assistant", f"unheard-{uuid.uuid4().hex[:8]}", owner=TEST_PRINCIPAL
    )
    started = await db(
        turn_start_programmatic, conversation_id=agent.conversation_id, messages=["count to 2"], enqueue=False
    )
    fiber = await Fiber.objects.aget(conversation_id=agent.conversation_id, request_id=started.request_id)
    runner = await turn_run(str(fiber.pk))
    assert runner is not None and runner.outcome == "completed"
    row = await TurnCompletion.objects.aget(conversation_id=agent.conversation_id)
    assert (row.ending, row.attempts) == ("completed", 0) and row.delivered_at is not None
    assert row.claimed_at is None, "never claimed: nobody delivered it"


async def test_a_receiver_connected_for_one_agent_class_hears_of_its_completed_turns(
    quiet_broker: dict[str, list[Any]],
) -> None:
    """`sender` is the agent class: a receiver connected for that class alone (the README's way to answer
    one agent's webhooks) is somebody who hears, so the ending is delivered to it, not recorded as
    nobody's."""
    got: list[Any] = []

    def receiver(sender: Any, *, result: Any, **kwargs: Any) -> None:
        got.append(result)

    turn_completed.connect(receiver, sender=agent_class("assistant"), weak=False)
    try:
        agent = await sync_to_async(open_agent)(
            "assistant", f"heard-{uuid.uuid4().hex[:8]}", owner=TEST_PRINCIPAL
        )
        started = await db(
            turn_start_programmatic,
            conversation_id=agent.conversation_id,
            messages=["count to 2"],
            enqueue=False,
        )
        fiber = await Fiber.objects.aget(conversation_id=agent.conversation_id, request_id=started.request_id)
        runner = await turn_run(str(fiber.pk))
        assert runner is not None and runner.outcome == "completed"
        await asyncio.to_thread(wait_until, lambda: len(got) == 1, 10, "the class's receiver called")
        await asyncio.sleep(0.3)
        [result] = got
        assert (result.request_id, result.ending, result.text) == (started.request_id, "completed", "1 2")
        row = await TurnCompletion.objects.aget(conversation_id=agent.conversation_id)
        assert row.attempts == 1 and row.delivered_at is not None
    finally:
        turn_completed.disconnect(receiver, sender=agent_class("assistant"))
