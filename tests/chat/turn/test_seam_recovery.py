"""A recovered answer has no seam (issue 39, item 1): the turn is cut off mid-answer, recovery continues
it, and the scripted model answers the continuation with a real model's habit (the last words again,
the sentence again, the whole answer again glued on). The stored answer is the story, exactly once.

Turns run in the test process through the real path (tests/inprocess.py: the runner, the engine, the
alarm), against the scripted model through litellm's OpenAI route."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.agents import open_agent
from tests.inprocess import interrupted_turn, recovered_run
from tests.support import TEST_PRINCIPAL
from think_scripted.server import STORY

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("in_process_model")]

CUT = " ".join(STORY.split()[:12])  # "... It mixed paints at night": mid-sentence


@pytest.mark.parametrize("habit", ["", "[repeat 3]", "[repeat 9]", "[restart]", "[restart all]"])
async def test_a_recovered_answer_holds_the_story_once(
    habit: str, quiet_broker: dict[str, list[Any]]
) -> None:
    agent = await sync_to_async(open_agent)("assistant", f"seam-{uuid.uuid4().hex[:8]}", owner=TEST_PRINCIPAL)
    interrupted = await interrupted_turn(agent, f"[story] {habit} [stall after 12]", until=CUT)
    runner = await recovered_run(interrupted, quiet_broker)
    assert runner is not None and runner.outcome == "completed"

    answer = (await sync_to_async(agent.messages)())[-1]
    text = "".join(part["text"] for part in answer["parts"] if part["type"] == "text")
    assert text == STORY
