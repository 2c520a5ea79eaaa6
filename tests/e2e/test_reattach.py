"""Recovery without regenerating: a model_reattach agent's turn, its worker SIGKILLed mid-answer, rejoins
the provider's stored generation (the scripted model's Responses API in background mode) after the last
stored event, instead of asking the model again.

The scripted model counts the generations it starts and the tokens each produced, so "one generation
billed" is measured at the provider, and the recovered text is compared with the provider's own output.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.transcript.selectors import conversation_get, messages_list
from recovery.models import Fiber
from tests.agents import tool_runs
from tests.support import (
    ChatClient,
    ConversationLog,
    assistant_text,
    chat_request,
    follow_conversation,
    numbers,
    user_message,
)
from think_scripted.server import ScriptedModelServer

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

AGENT = "reattach-agent"


@pytest.fixture(autouse=True)
def own_workers(recovery_stack: Any) -> Any:
    yield
    recovery_stack.stop_workers()


def provider_text(server: ScriptedModelServer, response_id: str) -> str:
    """The output text of a stored response, as the provider itself has it (GET /v1/responses/{id})."""
    with urllib.request.urlopen(f"{server.url}/responses/{response_id}", timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "completed", body["status"]
    return "".join(
        part.get("text", "")
        for item in body["output"]
        if item.get("type") == "message"
        for part in item.get("content", [])
    )


def stored(name: str) -> list[dict[str, Any]]:
    conversation = conversation_get(agent=AGENT, name=name)
    assert conversation is not None
    return messages_list(conversation_id=conversation.pk)


async def killed_mid_answer(stack: Any, prompt: str, *, kill_after: int) -> tuple[ConversationLog, str]:
    """Start a turn, SIGKILL its worker after `kill_after` chunks, start another, follow it to the end."""
    worker = stack.start_worker()
    name = f"reattach-{uuid.uuid4().hex[:8]}"
    async with ChatClient(stack.port, name, agent=AGENT) as client:
        request_id = uuid.uuid4().hex[:10]
        await client.send(chat_request(request_id, [user_message(prompt)]))
        log = await follow_conversation(
            client, until=lambda log: len(log.stream(request_id).chunks) >= kill_after, timeout=30
        )
        worker.kill(signal.SIGKILL)
        await asyncio.to_thread(stack.start_worker)
        await follow_conversation(client, log, timeout=60)
    for stream in log.streams.values():
        assert stream.seqs == list(range(len(stream.seqs))), "every stream gap-free and duplicate-free"
    return log, name


def new_responses(server: ScriptedModelServer, before: dict[str, int]) -> dict[str, int]:
    return {rid: tokens for rid, tokens in server.response_output_tokens.items() if rid not in before}


async def test_a_killed_worker_rejoins_the_providers_generation(
    recovery_stack: Any, scripted_model: ScriptedModelServer
) -> None:
    before = dict(scripted_model.response_output_tokens)
    created = scripted_model.responses_created
    log, name = await killed_mid_answer(recovery_stack, "count to 120 [rate 25]", kill_after=15)

    assert len(log.order) == 2, "the dead turn, then the continuation that rejoined its generation"
    assert log.text == numbers(120), "every number exactly once, across both streams"
    assert scripted_model.responses_created - created == 1, "one generation billed"
    [(response_id, tokens)] = new_responses(scripted_model, before).items()
    assert tokens == 120, "the provider generated the answer once, and only once"
    transcript = await sync_to_async(stored)(name)
    assert [m["role"] for m in transcript].count("user") == 1
    assert assistant_text(transcript) == await asyncio.to_thread(provider_text, scripted_model, response_id)
    continuation = await Fiber.objects.aget(request_id=log.order[1])
    assert continuation.status == Fiber.Status.COMPLETED
    assert continuation.snapshot["reattach"]["done"] is True, "the cursor reached the end of the response"


async def test_a_response_the_provider_no_longer_has_falls_back_to_continuing(
    recovery_stack: Any, scripted_model: ScriptedModelServer
) -> None:
    """[forget]: the provider drops the stored response, so the rejoin is a 404; the turn continues the
    ordinary way (a new generation asked to continue) and still ends with every number once."""
    created = scripted_model.responses_created
    log, name = await killed_mid_answer(recovery_stack, "count to 60 [rate 25] [forget]", kill_after=12)

    assert log.text == numbers(60)
    assert scripted_model.responses_created - created == 2, "the fallback pays for a second generation"
    assert assistant_text(await sync_to_async(stored)(name)) == numbers(60)
    logs = "".join(worker.log() for worker in recovery_stack.workers)
    assert "cannot reattach to" in logs and "not_found" in logs, "the fallback says why"


async def test_a_tool_turn_through_the_responses_api(recovery_stack: Any) -> None:
    """Tools follow the normal rules on the Responses path: the call, the server tool's result, the
    follow-up step (a second generation, given the result)."""
    recovery_stack.start_worker()
    name = f"reattach-tool-{uuid.uuid4().hex[:8]}"
    async with ChatClient(recovery_stack.port, name, agent=AGENT) as client:
        await client.send(chat_request("t1", [user_message('[tool get_weather {"city": "Paris"}]')]))
        stream = await client.follow("t1", timeout=30)
    assert stream.done is not None and stream.done["outcome"] == "completed"
    types = [chunk["type"] for _, chunk in stream.chunks]
    assert "tool-input-available" in types and "tool-output-available" in types
    assert stream.text.startswith("Tool get_weather returned:")


async def test_a_recovered_turn_killed_again_rejoins_again(
    recovery_stack: Any, scripted_model: ScriptedModelServer
) -> None:
    """The continuation records its own progress in the same generation: a second kill, in the middle
    of the rejoined stream, rejoins it once more, further on. The generation (400 tokens at 15 a second)
    outlasts a worker's start-up, which took 12 s on a slow machine: a rejoin after the provider has
    finished gets the rest at once, and there would be no middle to kill. Once the second kill is
    done, the model hurries: the rest of the generation comes at once, for the third worker to rejoin."""
    created = scripted_model.responses_created
    worker = recovery_stack.start_worker()
    name = f"reattach-twice-{uuid.uuid4().hex[:8]}"
    async with ChatClient(recovery_stack.port, name, agent=AGENT) as client:
        await client.send(chat_request("first", [user_message("count to 400 [rate 15]")]))
        log = await follow_conversation(client, until=lambda log: len(log.stream("first").chunks) >= 15)
        worker.kill(signal.SIGKILL)
        worker = await asyncio.to_thread(recovery_stack.start_worker)
        log = await follow_conversation(
            client, log, until=lambda log: len(log.order) == 2 and len(log.streams[log.order[1]].chunks) >= 15
        )
        worker.kill(signal.SIGKILL)
        scripted_model.hurry()
        try:
            await asyncio.to_thread(recovery_stack.start_worker)
            await follow_conversation(client, log, timeout=60)
        finally:
            scripted_model.hurry(False)
    assert len(log.order) == 3
    for stream in log.streams.values():
        assert stream.seqs == list(range(len(stream.seqs)))
    assert log.text == numbers(400)
    assert scripted_model.responses_created - created == 1, "still the one generation"
    assert assistant_text(await sync_to_async(stored)(name)) == numbers(400)


async def test_a_settled_tool_result_is_never_run_again_when_the_next_step_is_rejoined(
    recovery_stack: Any, scripted_model: ScriptedModelServer
) -> None:
    """Step 1 calls `add` (a server tool that counts its runs), step 2 streams the answer: the worker is
    killed in step 2, and the continuation rejoins step 2's generation; the tool ran once, and the two
    generations the turn needs are all the provider was asked for."""
    tag = uuid.uuid4().hex[:8]
    before = dict(scripted_model.response_output_tokens)
    created = scripted_model.responses_created
    log, name = await killed_mid_answer(
        recovery_stack, f'[tool add {{"tag": "{tag}", "a": 2, "b": 3}}] count to 100 [rate 25]', kill_after=25
    )
    assert tool_runs(tag) == 1, "the settled result was kept, not produced again"
    assert scripted_model.responses_created - created == 2, "the tool step and the answer, nothing more"
    step_two = list(new_responses(scripted_model, before))[-1]  # in the order they were created
    transcript = await sync_to_async(stored)(name)
    text = assistant_text(transcript)
    assert text == await asyncio.to_thread(provider_text, scripted_model, step_two)
    assert text.endswith(numbers(100)) and "returned: 5" in text
    settled = [
        part
        for message in transcript
        for part in message["parts"]
        if part.get("type") == "tool-add" and part.get("state") == "output-available"
    ]
    assert len(settled) == 1 and settled[0]["output"] == 5
    assert len(log.order) == 2
