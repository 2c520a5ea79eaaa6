"""Stop everything of a conversation (chat.transcript.stop, chat.turn.actions), durably, in one transaction.

Turns run in the test process through the real path (tests/inprocess.py: the runner, the tick's
takeover, the engine, the alarms); what would reach the broker is recorded (quiet_broker), so nothing
runs unless the test runs it.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.core.management import call_command
from django.core.management.base import CommandError

from chat import protocol as p
from chat.agents import open_agent
from chat.models import Conversation, Message, Submission
from chat.transcript.selectors import chain_outcome
from chat.transcript.services import message_upsert
from chat.transcript.snapshot import TurnKind
from chat.transcript.stop import STOPPED, STOPPED_TOOL_ERROR, conversation_stop
from chat.transcript.submissions import submission_create
from chat.transcript.turns import turn_start_programmatic, turn_start_recovered
from chat.turn.actions import astop_conversation
from chat.turn.runner import turn_run
from recovery.engine.alarms import afire_alarm
from recovery.engine.spine import arecover_fiber
from recovery.engine.store import incident_get, incident_save, incident_set_status
from recovery.lease.fibers import conversation_busy
from recovery.models import Alarm, Fiber, Incident, Segment, Stream
from recovery.process.runtime import db
from tests.inprocess import interrupted_turn, stored_text
from tests.support import TEST_PRINCIPAL

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("in_process_model")]


def new_agent(agent: str = "assistant") -> Any:
    return open_agent(agent, f"stopall-{uuid.uuid4().hex[:8]}", owner=TEST_PRINCIPAL)


def tool(state: str, call: str, name: str = "x", **extra: Any) -> dict[str, Any]:
    return {"type": f"tool-{name}", "toolCallId": call, "state": state, "input": {"q": call}, **extra}


def assistant_texts(agent: Any) -> list[str]:
    return [
        "".join(part.get("text", "") for part in m["parts"] if part["type"] == "text")
        for m in agent.messages()
        if m["role"] == "assistant"
    ]


# -- the wire frames ---------------------------------------------------------------------------------------
def test_the_stop_frame_parses_and_the_stopped_frame_says_what_ended() -> None:
    assert p.parse_frame('{"type":"cf_agent_chat_stop"}') == p.Stop()
    frame = json.loads(p.chat_stopped_frame({"requestIds": ["r1"], "toolCalls": ["c1"]}))
    assert frame == {"type": "cf_agent_chat_stopped", "requestIds": ["r1"], "toolCalls": ["c1"]}


# -- a running turn ----------------------------------------------------------------------------------------
async def test_a_stop_ends_the_running_turn_keeps_what_it_stored_and_frees_the_conversation(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = await sync_to_async(new_agent)()
    started = await db(
        turn_start_programmatic,
        conversation_id=agent.conversation_id,
        messages=["count to 400 [rate 40]"],
        enqueue=False,
    )
    fiber = await Fiber.objects.aget(conversation_id=agent.conversation_id, request_id=started.request_id)
    running = asyncio.ensure_future(turn_run(str(fiber.pk)))
    deadline = time.monotonic() + 15
    while len((await stored_text(fiber.pk)).split()) < 5:
        assert time.monotonic() < deadline, "the turn stored its first numbers"
        await asyncio.sleep(0.05)

    report = await astop_conversation(agent.conversation_id)
    stored_at_stop = await stored_text(fiber.pk)
    segments_at_stop = await Segment.objects.filter(stream__fiber_id=fiber.pk).acount()
    await asyncio.wait_for(running, 10)  # the turn hears of it (signal or fenced flush) and ends

    assert [s.request_id for s in report.streams] == [started.request_id] and not report.queued
    await fiber.arefresh_from_db()
    assert fiber.status == Fiber.Status.CANCELLED
    assert await Segment.objects.filter(stream__fiber_id=fiber.pk).acount() == segments_at_stop, (
        "nothing of the turn is stored after the stop committed"
    )
    stream = await Stream.objects.aget(fiber_id=fiber.pk)
    assert stream.status == Stream.Status.COMPLETED
    assert report.streams[0].seq == (await Segment.objects.filter(stream=stream).alast()).seq_end + 1  # type: ignore[union-attr]
    texts = await sync_to_async(assistant_texts)(agent)
    assert texts == [stored_at_stop], "the stored answer is exactly what was streamed before the stop"
    [message] = [m for m in await sync_to_async(agent.messages)() if m["role"] == "assistant"]
    assert all(part.get("state") in (None, "done") for part in message["parts"]), message["parts"]
    assert await db(
        chain_outcome, conversation_id=agent.conversation_id, root_request_id=started.request_id
    ) == ("aborted")

    # The next message is new work: accepted at once, nothing ahead of it.
    assert not await db(conversation_busy, agent.conversation_id)
    nxt = await db(
        turn_start_programmatic, conversation_id=agent.conversation_id, messages=["count to 3"], timeout=2
    )
    assert nxt.status == "accepted"
    runner = await turn_run(str((await Fiber.objects.aget(request_id=nxt.request_id)).pk))
    assert runner is not None and runner.outcome == "completed"
    assert (await sync_to_async(assistant_texts)(agent))[-1] == "1 2 3"


# -- the queue, submissions, waiting tool calls ------------------------------------------------------------
def test_a_stop_cancels_queued_turns_submissions_and_every_waiting_tool_call(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = new_agent()
    cid = agent.conversation_id
    message_upsert(
        conversation_id=cid, message={"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}
    )
    waiting = {
        "id": "a1",
        "role": "assistant",
        "parts": [
            {"type": "text", "text": "Let me check.", "state": "done"},
            tool("output-available", "done-1", output={"ok": True}),
            tool("approval-requested", "ask-1", approval={"id": "ap-1"}),
            tool("input-available", "client-1", name="geolocation"),
            tool("approval-responded", "approved-1", approval={"id": "ap-2", "approved": True}),
        ],
    }
    message_upsert(conversation_id=cid, message=waiting)
    queued = turn_start_programmatic(conversation_id=cid, messages=["and then?"], enqueue=False)
    submission = submission_create(conversation_id=cid, messages=["later"])
    Conversation.objects.filter(pk=cid).update(continue_armed="a1", tool_updates=[{"toolCallId": "x"}])

    report = conversation_stop(conversation_id=cid)

    assert report.queued == (queued.request_id,) and not report.streams
    assert report.submissions == (submission.submission_id,)
    assert report.tool_calls == ("ask-1", "client-1", "approved-1")
    assert Fiber.objects.get(request_id=queued.request_id).status == Fiber.Status.CANCELLED
    row = Submission.objects.get(submission_id=submission.submission_id)
    assert (row.status, row.error) == (Submission.Status.ABORTED, "The conversation was stopped.")
    parts = {p.get("toolCallId"): p for p in Message.objects.get(conversation_id=cid, message_id="a1").parts}
    for call in ("ask-1", "client-1", "approved-1"):
        assert (parts[call]["state"], parts[call]["errorText"]) == ("output-error", STOPPED_TOOL_ERROR)
        assert parts[call]["input"] == {"q": call}
    assert parts["done-1"]["state"] == "output-available", "a settled result is never touched"
    conversation = Conversation.objects.get(pk=cid)
    assert (conversation.continue_armed, conversation.tool_updates) == ("", [])
    assert not Alarm.objects.filter(conversation_id=cid, status=Alarm.Status.PENDING).exists()
    for alarm_id in quiet_broker[
        "alarms"
    ]:  # the drain alarm was claimed at once: it fires, and finds nothing
        async_to_sync(afire_alarm)(alarm_id)
    assert quiet_broker["turns"] == [] and not Fiber.objects.filter(conversation_id=cid).active().exists()
    assert not conversation_busy(cid)
    assert not agent.has_pending_interaction(), "nothing waits for a human any more"

    again = conversation_stop(conversation_id=cid)
    assert not again.stopped_anything, "a second stop finds nothing to stop"


# -- recovery ------------------------------------------------------------------------------------------------
async def test_a_stop_before_the_engine_handles_a_killed_turn_leaves_nothing_to_resume(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = await sync_to_async(new_agent)()
    interrupted = await interrupted_turn(agent, "count to 6 [stall after 3]")

    report = await astop_conversation(agent.conversation_id)
    assert [s.request_id for s in report.streams] == [interrupted.request_id]
    await arecover_fiber(interrupted.pk)  # the tick's hand-over, arriving after the stop

    assert not await Incident.objects.filter(conversation_id=agent.conversation_id).aexists()
    assert quiet_broker["alarms"] == [] and quiet_broker["turns"] == []
    assert await sync_to_async(assistant_texts)(agent) == ["1 2 3"], "the partial is kept, once"
    await interrupted.arefresh_from_db()
    assert interrupted.status == Fiber.Status.CANCELLED


@pytest.mark.parametrize("stop_when", ["before_the_incident", "after_the_incident"])
async def test_a_stop_racing_the_engine_that_loaded_the_killed_turn_leaves_nothing_to_resume(
    stop_when: str, quiet_broker: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine loaded the interrupted fiber, then a stop commits: before the engine opens its
    incident (the fiber is no longer interrupted under the lock: no incident), or just after (the
    incident is cancelled: nothing is scheduled, the recovering flag stays down)."""
    import recovery.engine.spine

    agent = await sync_to_async(new_agent)()
    interrupted = await interrupted_turn(agent, "count to 6 [stall after 3]")
    begin = recovery.engine.spine.incident_begin

    def racing_begin(**kwargs: Any) -> Any:
        if stop_when == "before_the_incident":
            conversation_stop(conversation_id=agent.conversation_id)
            return begin(**kwargs)
        evaluation = begin(**kwargs)
        conversation_stop(conversation_id=agent.conversation_id)
        return evaluation

    monkeypatch.setattr(recovery.engine.spine, "incident_begin", racing_begin)
    await arecover_fiber(interrupted.pk)

    assert quiet_broker["alarms"] == [] and quiet_broker["turns"] == []
    assert not await Alarm.objects.filter(conversation_id=agent.conversation_id).aexists()
    incidents = [i async for i in Incident.objects.filter(conversation_id=agent.conversation_id)]
    if stop_when == "before_the_incident":
        assert incidents == []
    else:
        assert [(i.status, i.reason) for i in incidents] == [("cancelled", STOPPED)]
    conversation = await Conversation.objects.aget(pk=agent.conversation_id)
    assert conversation.recovering is None
    await interrupted.arefresh_from_db()
    assert interrupted.status == Fiber.Status.CANCELLED
    assert await sync_to_async(assistant_texts)(agent) == ["1 2 3"], "the partial is kept, once"


async def test_a_stop_after_the_continuation_was_scheduled_cancels_its_incident_and_nothing_resumes(
    quiet_broker: dict[str, list[Any]],
) -> None:
    """The continuation's alarm was claimed already (it fires at once): it still fires after the stop,
    and does nothing."""
    agent = await sync_to_async(new_agent)()
    interrupted = await interrupted_turn(agent, "count to 6 [stall after 3]")
    await arecover_fiber(interrupted.pk)
    incident = await Incident.objects.aget(conversation_id=agent.conversation_id)
    assert incident.status == "scheduled"
    [alarm_id] = quiet_broker["alarms"]

    report = await astop_conversation(agent.conversation_id)
    assert report.incidents == (incident.incident_id,) and report.recovering

    await afire_alarm(alarm_id)  # the claimed alarm fires anyway
    assert quiet_broker["turns"] == [], "no continuation was started"
    await incident.arefresh_from_db()
    assert (incident.status, incident.reason) == ("cancelled", STOPPED)
    assert not await Fiber.objects.filter(conversation_id=agent.conversation_id).active().aexists()
    assert (
        await db(chain_outcome, conversation_id=agent.conversation_id, root_request_id=interrupted.request_id)
        == "aborted"
    )
    conversation = await Conversation.objects.aget(pk=agent.conversation_id)
    assert conversation.recovering is None


def test_an_incident_a_stop_closed_is_never_reopened_nor_continued(
    quiet_broker: dict[str, list[Any]],
) -> None:
    """What a continuation racing the stop meets: the engine's later writes keep the incident cancelled,
    and the continuation, started under the conversation's lock, is skipped."""
    agent = new_agent()
    cid = agent.conversation_id
    message_upsert(
        conversation_id=cid, message={"id": "u1", "role": "user", "parts": [{"type": "text", "text": "q"}]}
    )
    message_upsert(
        conversation_id=cid,
        message={
            "id": "a1",
            "role": "assistant",
            "parts": [{"type": "text", "text": "1 2", "state": "done"}],
        },
    )
    now = int(time.time() * 1000)
    Incident.objects.create(
        conversation_id=cid,
        incident_id="root:u1",
        request_id="root",
        recovery_root_request_id="root",
        recovery_kind="continue",
        max_attempts=3,
        status="scheduled",
        first_seen_at=now,
        last_attempt_at=now,
    )
    conversation_stop(conversation_id=cid)

    assert incident_set_status(conversation_id=cid, incident_id="root:u1", status="running") is None
    stored = incident_get(conversation_id=cid, incident_id="root:u1")
    assert stored is not None and stored.status == "cancelled"
    from dataclasses import replace

    incident_save(conversation_id=cid, incident=replace(stored, status="scheduled", attempt=2))
    assert incident_get(conversation_id=cid, incident_id="root:u1").status == "cancelled"  # type: ignore[union-attr]

    started = turn_start_recovered(
        conversation_id=cid, kind=TurnKind.CONTINUE, root_request_id="root", incident_id="root:u1"
    )
    assert started.status == "skipped"
    assert quiet_broker["turns"] == [] and not Fiber.objects.filter(conversation_id=cid).exists()
    # The same continuation without the incident is a plain one, and goes.
    assert (
        turn_start_recovered(
            conversation_id=cid, kind=TurnKind.CONTINUE, root_request_id="", incident_id=None
        ).status
        == "accepted"
    )


# -- operators -------------------------------------------------------------------------------------------
def test_the_stop_command_names_what_it_stopped_and_refuses_an_unknown_conversation(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = new_agent()
    queued = turn_start_programmatic(conversation_id=agent.conversation_id, messages=["hi"], enqueue=False)
    out = io.StringIO()
    call_command("think_stop", f"assistant/{agent.name}", stdout=out, no_color=True)
    assert f"turn {queued.request_id}" in out.getvalue()
    assert "Stopped" in out.getvalue() and "1 turn(s)" in out.getvalue()
    out = io.StringIO()
    call_command("think_stop", f"assistant/{agent.name}", stdout=out, no_color=True)
    assert "had nothing to stop" in out.getvalue()
    with pytest.raises(CommandError, match="no conversation assistant/nobody-here"):
        call_command("think_stop", "assistant/nobody-here")
    with pytest.raises(CommandError, match="is not AGENT/NAME"):
        call_command("think_stop", "just-a-name")
