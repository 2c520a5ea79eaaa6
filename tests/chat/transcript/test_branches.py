"""Regenerate and edit keep branches (chat.transcript.branches), and recovery keeps a turn on its branch.

Turns run in the test process through the real path (the runner, the scripted model, the engine, the
alarms); what would reach the broker is recorded (quiet_broker), so nothing runs unless the test runs it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat import protocol as p
from chat.agents import open_agent
from chat.exceptions import BranchNotFound, ConversationBusy
from chat.models import Branch, Compaction, Message
from chat.protocol import ChatRequest
from chat.transcript.branches import BRANCH_KEY, branch_switch
from chat.transcript.selectors import messages_list
from chat.transcript.turns import turn_accept
from chat.transcript.window import transcript_window
from chat.turn.runner import turn_run
from recovery.engine.alarms import afire_alarm
from recovery.engine.spine import arecover_fiber
from recovery.models import Fiber
from recovery.process.runtime import db
from tests.inprocess import stored_text, take_released
from tests.support import TEST_PRINCIPAL

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("in_process_model")]


def new_agent() -> Any:
    return open_agent("assistant", f"branch-{uuid.uuid4().hex[:8]}", owner=TEST_PRINCIPAL)


def user(text: str, message_id: str) -> dict[str, Any]:
    return {"id": message_id, "role": "user", "parts": [{"type": "text", "text": text}]}


def texts(messages: list[dict[str, Any]]) -> list[str]:
    return ["".join(part.get("text", "") for part in m["parts"] if part["type"] == "text") for m in messages]


def notes(conversation_id: int) -> dict[str, Any]:
    """The branch annotations clients see, by message id."""
    window = transcript_window(conversation_id=conversation_id)
    return {
        m["id"]: m["metadata"][BRANCH_KEY] for m in window.messages if BRANCH_KEY in (m.get("metadata") or {})
    }


async def run_request(
    conversation_id: int, messages: list[dict[str, Any]], trigger: str = "submit-message"
) -> str:
    """Accept a client's request as the socket does and run its turn here; its request id."""
    request = ChatRequest(uuid.uuid4().hex[:8], messages, trigger)
    accepted = await db(turn_accept, conversation_id=conversation_id, request=request)
    assert not accepted.refused, accepted.refused
    runner = await turn_run(str(accepted.fiber_id))
    assert runner is not None and runner.outcome == "completed"
    return request.id


async def test_regenerate_twice_keeps_three_answers_and_each_comes_back(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = await sync_to_async(new_agent)()
    cid = agent.conversation_id
    question = user("count to 3", "u1")
    await run_request(cid, [question])
    await run_request(cid, [question], "regenerate-message")
    await run_request(cid, [question], "regenerate-message")

    messages = await db(messages_list, conversation_id=cid)
    assert [m["role"] for m in messages] == ["user", "assistant"], "the branch in use is linear"
    answers = [m["id"] for m in messages[1:]]
    assert await Branch.objects.filter(conversation_id=cid).acount() == 2
    assert (await db(notes, cid))[answers[0]] == {"anchorId": "u1", "index": 2, "count": 3}

    assert await db(branch_switch, conversation_id=cid, anchor_message_id="u1", index=0)
    first = await db(messages_list, conversation_id=cid)
    assert texts(first) == ["count to 3", "1 2 3"] and first[1]["id"] != answers[0]
    assert (await db(notes, cid))[first[1]["id"]] == {"anchorId": "u1", "index": 0, "count": 3}
    assert not await db(branch_switch, conversation_id=cid, anchor_message_id="u1", index=0), "already shown"
    assert await db(branch_switch, conversation_id=cid, anchor_message_id="u1", index=2)
    assert [m["id"] for m in await db(messages_list, conversation_id=cid)] == ["u1", answers[0]]
    positions = [m.position async for m in Message.objects.filter(conversation_id=cid).order_by("position")]
    assert positions == [0, 1]
    assert await Branch.objects.filter(conversation_id=cid).acount() == 2, "nothing lost, nothing doubled"


async def test_editing_a_user_message_makes_a_branch_there(quiet_broker: dict[str, list[Any]]) -> None:
    agent = await sync_to_async(new_agent)()
    cid = agent.conversation_id
    await run_request(cid, [user("count to 2", "u1")])
    history = await db(messages_list, conversation_id=cid)
    await run_request(cid, [*history, user("count to 3", "u2")])
    history = await db(messages_list, conversation_id=cid)

    edited = user("count to 4", "u2")  # the AI SDK's sendMessage({text, messageId}): same id, new text
    await run_request(cid, [*history[:2], edited])
    assert texts(await db(messages_list, conversation_id=cid)) == [
        "count to 2",
        "1 2",
        "count to 4",
        "1 2 3 4",
    ]
    assert (await db(notes, cid))["u2"] == {"anchorId": history[1]["id"], "index": 1, "count": 2}

    assert await db(branch_switch, conversation_id=cid, anchor_message_id=history[1]["id"], index=0)
    assert texts(await db(messages_list, conversation_id=cid)) == ["count to 2", "1 2", "count to 3", "1 2 3"]


async def test_answers_set_aside_under_a_question_stay_with_that_version_when_it_is_edited(
    quiet_broker: dict[str, list[Any]],
) -> None:
    """An edit keeps the message's id: the answer regenerated under the old question must not be
    offered (nor switched in) under the edited one, and comes back with the old question."""
    agent = await sync_to_async(new_agent)()
    cid = agent.conversation_id
    await run_request(cid, [user("count to 2", "u1")])
    history = await db(messages_list, conversation_id=cid)
    await run_request(cid, [*history, user("count to 3", "u2")])
    await run_request(cid, [*history, user("count to 3", "u2")], "regenerate-message")
    assert (await db(notes, cid)).get((await db(messages_list, conversation_id=cid))[3]["id"]) == {
        "anchorId": "u2",
        "index": 1,
        "count": 2,
    }

    await run_request(cid, [*history, user("count to 4", "u2")])  # the edit
    edited = await db(messages_list, conversation_id=cid)
    assert texts(edited) == ["count to 2", "1 2", "count to 4", "1 2 3 4"]
    assert await db(notes, cid) == {"u2": {"anchorId": history[1]["id"], "index": 1, "count": 2}}
    assert not await db(branch_switch, conversation_id=cid, anchor_message_id="u2", index=0), "the one in use"
    with pytest.raises(BranchNotFound):
        await db(branch_switch, conversation_id=cid, anchor_message_id="u2", index=1)

    assert await db(branch_switch, conversation_id=cid, anchor_message_id=history[1]["id"], index=0)
    old = await db(messages_list, conversation_id=cid)
    assert texts(old) == ["count to 2", "1 2", "count to 3", "1 2 3"]
    assert (await db(notes, cid))[old[3]["id"]] == {"anchorId": "u2", "index": 1, "count": 2}
    assert await db(branch_switch, conversation_id=cid, anchor_message_id="u2", index=0)
    assert texts(await db(messages_list, conversation_id=cid)) == ["count to 2", "1 2", "count to 3", "1 2 3"]
    assert await Branch.objects.filter(conversation_id=cid).acount() == 2, "nothing lost, nothing doubled"


async def test_an_echo_of_a_message_cut_for_display_is_not_an_edit(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = await sync_to_async(new_agent)()
    cid = agent.conversation_id
    await run_request(cid, [user("count to 2", "u1")])
    history = await db(messages_list, conversation_id=cid)
    cut = {
        **history[0],
        "parts": [{"type": "text", "text": "count"}],
        "metadata": {"thinkTruncated": {"bytes": 9}},
    }
    request = ChatRequest("r-echo", [cut], "submit-message")
    await db(turn_accept, conversation_id=cid, request=request)
    assert not await Branch.objects.filter(conversation_id=cid).aexists()


async def test_a_regeneration_killed_mid_stream_is_recovered_on_its_own_branch(
    quiet_broker: dict[str, list[Any]],
) -> None:
    agent = await sync_to_async(new_agent)()
    cid = agent.conversation_id
    question = user("count to 30 [rate 40]", "u1")
    await run_request(cid, [question])
    original = texts(await db(messages_list, conversation_id=cid))[1]

    request = ChatRequest("r-regen", [question], "regenerate-message")
    accepted = await db(turn_accept, conversation_id=cid, request=request)
    running = asyncio.ensure_future(turn_run(str(accepted.fiber_id)))
    deadline = time.monotonic() + 15
    while len((await stored_text(accepted.fiber_id)).split()) < 3:
        assert time.monotonic() < deadline, "the regeneration stored its first numbers"
        await asyncio.sleep(0.02)
    running.cancel()  # its worker stops: what it stored stays, its lease lapses
    with pytest.raises(asyncio.CancelledError):
        await running
    assert await take_released() == [accepted.fiber_id]
    with pytest.raises(ConversationBusy):  # nobody switches the branch under a recovering turn
        await db(branch_switch, conversation_id=cid, anchor_message_id="u1", index=0)

    await arecover_fiber(accepted.fiber_id)
    [alarm_id] = quiet_broker["alarms"]
    sent = len(quiet_broker["turns"])  # the accepted turns were "sent" too (and run here)
    await afire_alarm(alarm_id)
    [continuation] = quiet_broker["turns"][sent:]
    runner = await turn_run(str(continuation))
    assert runner is not None and runner.outcome == "completed"

    messages = await db(messages_list, conversation_id=cid)
    assert texts(messages) == ["count to 30 [rate 40]", " ".join(str(i) for i in range(1, 31))]
    assert (await db(notes, cid))[messages[1]["id"]] == {"anchorId": "u1", "index": 1, "count": 2}
    assert await db(branch_switch, conversation_id=cid, anchor_message_id="u1", index=0)
    assert texts(await db(messages_list, conversation_id=cid))[1] == original


def test_a_compaction_goes_with_its_branch_and_comes_back_with_it() -> None:
    agent = new_agent()
    cid = agent.conversation_id
    from chat.transcript.services import message_upsert

    for message_id, role, text in [
        ("u1", "user", "q"),
        ("a1", "assistant", "first"),
        ("u2", "user", "more"),
        ("a2", "assistant", "second"),
    ]:
        message_upsert(
            conversation_id=cid,
            message={"id": message_id, "role": role, "parts": [{"type": "text", "text": text}]},
        )
    Compaction.objects.create(
        conversation_id=cid,
        compaction_id="c1",
        from_message_id="a1",
        to_message_id="u2",
        summary="Summary of 2 lines.",
    )
    assert texts(messages_list(conversation_id=cid)) == ["q", "Summary of 2 lines.", "second"]

    from django.db import transaction

    from chat.transcript.branches import tail_set_aside
    from chat.transcript.services import conversation_lock

    with transaction.atomic():  # what a regenerate of u1's answer does
        conversation_lock(cid)
        tail_set_aside(conversation_id=cid, after_position=0)
    message_upsert(
        conversation_id=cid,
        message={"id": "b1", "role": "assistant", "parts": [{"type": "text", "text": "other"}]},
    )
    assert texts(messages_list(conversation_id=cid)) == ["q", "other"]
    assert not Compaction.objects.filter(conversation_id=cid).exists(), "it summarised the branch set aside"

    assert branch_switch(conversation_id=cid, anchor_message_id="u1", index=0)
    assert texts(messages_list(conversation_id=cid)) == ["q", "Summary of 2 lines.", "second"]
    assert texts(messages_list(conversation_id=cid, raw=True)) == ["q", "first", "more", "second"]
    assert branch_switch(conversation_id=cid, anchor_message_id="u1", index=1)
    assert texts(messages_list(conversation_id=cid)) == ["q", "other"]


def test_a_switch_is_refused_clearly_and_changes_nothing(quiet_broker: dict[str, list[Any]]) -> None:
    agent = new_agent()
    cid = agent.conversation_id
    from chat.transcript.services import message_upsert
    from chat.transcript.turns import turn_start_programmatic

    message_upsert(conversation_id=cid, message=user("q", "u1"))
    with pytest.raises(BranchNotFound, match="'nope' is not on the branch in use"):
        branch_switch(conversation_id=cid, anchor_message_id="nope", index=0)
    with pytest.raises(BranchNotFound, match="there are 0 alternative"):
        branch_switch(conversation_id=cid, anchor_message_id="u1", index=1)
    turn_start_programmatic(conversation_id=cid, messages=["more"], enqueue=False)
    with pytest.raises(ConversationBusy, match="switch branches when it ends"):
        branch_switch(conversation_id=cid, anchor_message_id="u1", index=0)
    assert [m["id"] for m in messages_list(conversation_id=cid)][0] == "u1"


def test_the_branch_frame_parses_and_refuses_bad_input() -> None:
    assert p.parse_frame('{"type":"cf_agent_chat_branch","anchorId":"u1","index":2}') == p.SwitchBranch(
        "u1", 2
    )
    assert p.parse_frame('{"type":"cf_agent_chat_branch","index":0}') == p.SwitchBranch("", 0)
    for bad in ('"index":-1', '"index":"1"', '"index":true', '"anchorId":5,"index":0'):
        with pytest.raises(p.ProtocolError):
            p.parse_frame('{"type":"cf_agent_chat_branch",' + bad + "}")


def test_an_edit_while_a_turn_runs_is_refused(quiet_broker: dict[str, list[Any]]) -> None:
    agent = new_agent()
    cid = agent.conversation_id
    from chat.transcript.services import message_upsert

    message_upsert(conversation_id=cid, message=user("count to 2", "u1"))
    Fiber.objects.create(conversation_id=cid, request_id="busy", kind="chat", status="running")
    accepted = turn_accept(
        conversation_id=cid, request=ChatRequest("r-edit", [user("count to 9", "u1")], "submit-message")
    )
    assert "an edited message starts a new branch" in accepted.refused
    assert texts(messages_list(conversation_id=cid)) == ["count to 2"]
