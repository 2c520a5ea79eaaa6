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

from chat.agents import Think, open_agent
from chat.turn.prefill import prefill_request, prefill_style
from recovery.observe import diagnostics
from tests.inprocess import interrupted_turn, recovered_run
from tests.support import TEST_PRINCIPAL
from think_scripted.server import STORY, ScriptedModelServer

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


class Prefiller(Think):
    continuation_style = "prefill"


async def test_by_prefill_the_partial_is_the_last_message_and_the_model_extends_it(
    quiet_broker: dict[str, Any], scripted_model: ScriptedModelServer, settings: Any
) -> None:
    """An agent that continues by prefill sends the partial as the final assistant message with no
    instruction after it; the scripted model extends it (with the habit of repeating its last words, which
    the seam still drops), and chat:continuation:style says which way was taken."""
    agents = {**settings.THINK["AGENTS"], "prefiller": f"{__name__}.Prefiller"}
    settings.THINK = {**settings.THINK, "AGENTS": agents}
    styles: list[str] = []
    before = len(scripted_model.chats)
    unsubscribe = diagnostics.subscribe(
        "chat",
        lambda event: (
            styles.append(event["payload"]["style"]) if event["type"] == "chat:continuation:style" else None
        ),
    )
    try:
        agent = await sync_to_async(open_agent)(
            "prefiller", f"pre-{uuid.uuid4().hex[:8]}", owner=TEST_PRINCIPAL
        )
        interrupted = await interrupted_turn(agent, "[story] [repeat 3] [stall after 12]", until=CUT)
        runner = await recovered_run(interrupted, quiet_broker)
    finally:
        unsubscribe()
    assert runner is not None and runner.outcome == "completed"
    ours = scripted_model.chats[before:]  # the server is the session's: other tests' requests came first
    [continued] = [chat for chat in ours if chat[-1]["role"] == "assistant"]
    assert continued[-1]["content"] == CUT
    assert styles == ["prefill"]
    answer = (await sync_to_async(agent.messages)())[-1]
    assert "".join(part["text"] for part in answer["parts"] if part["type"] == "text") == STORY


def test_auto_prefills_where_the_provider_extends_a_final_assistant_message() -> None:
    assert prefill_style({"model": "anthropic/claude-sonnet-4"}) == "prefill"
    assert prefill_style({"model": "mistral/mistral-large-latest"}) == "prefill"
    assert prefill_style({"model": "hosted_vllm/Qwen/Qwen3-8B"}) == "prefill"
    assert prefill_style({"model": "openai/gpt-4o-mini"}) == "instruction"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, th"}]
    assert prefill_request({"model": "mistral/mistral-large-latest"}, messages) == {}
    assert messages[-1] == {"role": "assistant", "content": "Hello, th", "prefix": True}
    vllm = prefill_request({"model": "hosted_vllm/Qwen/Qwen3-8B"}, [])
    assert vllm == {"extra_body": {"continue_final_message": True, "add_generation_prompt": False}}
