"""The answer reaches whoever asked, across a SIGKILL: the agent's on_turn_completed runs once, on the
worker that finished the turn after the one that started it was killed, with the whole answer."""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any

import pytest

from chat.models import TurnCompletion
from tests.agents import completions_seen
from tests.support import (
    ChatClient,
    chat_request,
    follow_conversation,
    numbers,
    ticks_pass,
    user_message,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

AGENT = "completion-probe"


async def test_the_worker_that_finishes_a_killed_turn_reports_it_once(recovery_stack: Any) -> None:
    first = recovery_stack.start_worker()
    name = f"done-kill-{uuid.uuid4().hex[:8]}"
    try:
        async with ChatClient(recovery_stack.port, name, AGENT) as client:
            await client.send(chat_request("r-webhook", [user_message("count to 60 [rate 25]")]))
            log = await follow_conversation(
                client, until=lambda lg: len(lg.stream("r-webhook").chunks) >= 15, timeout=30
            )
            first.kill(signal.SIGKILL)
            second = await asyncio.to_thread(recovery_stack.start_worker)
            await follow_conversation(client, log, timeout=60)
        assert log.text == numbers(60)

        await asyncio.to_thread(
            wait_until, lambda: completions_seen(name), 15, "the turn's completion to be delivered"
        )
        await asyncio.to_thread(ticks_pass, 2)  # a second delivery (the tick's sweep) would show now
        [seen] = completions_seen(name)
        assert (seen["request_id"], seen["ending"], seen["text"]) == ("r-webhook", "recovered", numbers(60))
        assert seen["last_request_id"] != "r-webhook", "ended by the continuation"
        assert seen["pid"] == second.popen.pid != first.popen.pid, "reported by the worker that finished it"
        row = await TurnCompletion.objects.aget(conversation__name=name)
        assert row.delivered_at is not None and row.attempts == 1
    finally:
        recovery_stack.stop_workers()
