"""What turns spend: each model step's usage (input, output, cached tokens) and cost, on the message and
the fiber, on the diagnostics channel and in metrics; and recovery bounded by it (max_recovery_tokens).

Turns run in the test process through the real path (litellm to the scripted model, whose usage
figures are its documented token accounting: tests/test_scripted_model.py).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from decimal import Decimal
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.agents import ModelPrices, Think, open_agent
from chat.transcript.turns import turn_start_programmatic
from chat.turn.runner import turn_run
from recovery.engine.alarms import afire_alarm
from recovery.engine.spine import arecover_fiber
from recovery.lease.fibers import fiber_spend_add
from recovery.models import Fiber, Incident
from recovery.observe import diagnostics
from recovery.observe.metrics import MODEL_COST, MODEL_TOKENS
from recovery.process.runtime import db
from tests.agents import probe_key, probe_redis
from tests.inprocess import take_released
from think_scripted.server import count_prompt_tokens

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("in_process_model")]

PRICES = ModelPrices(input=Decimal("0.000003"), output=Decimal("0.000015"), cached_input=Decimal("0.0000003"))


def counter(metric: Any, **labels: str) -> float:
    return float((metric.labels(**labels) if labels else metric)._value.get())


async def run_turn(agent_name: str, prompt: str) -> tuple[Any, Fiber, list[dict[str, Any]]]:
    agent = await sync_to_async(open_agent)(agent_name, f"spend-{uuid.uuid4().hex[:8]}")
    started = await db(
        turn_start_programmatic, conversation_id=agent.conversation_id, messages=[prompt], enqueue=False
    )
    fiber = await Fiber.objects.aget(conversation_id=agent.conversation_id, request_id=started.request_id)
    runner = await turn_run(str(fiber.pk))
    assert runner is not None and runner.outcome == "completed"
    await fiber.arefresh_from_db()
    return agent, fiber, await sync_to_async(agent.messages)()


async def test_a_priced_step_records_its_usage_and_cost_everywhere(scripted_model: Any) -> None:
    events: list[dict[str, Any]] = []
    unsubscribe = diagnostics.subscribe("chat", events.append)
    tokens_before = {kind: counter(MODEL_TOKENS, kind=kind) for kind in ("input", "output", "cached")}
    cost_before = counter(MODEL_COST)
    try:
        _, fiber, messages = await run_turn("priced-agent", "count to 5 [cached 8]")
    finally:
        unsubscribe()
    prompt = count_prompt_tokens(scripted_model.chats[-1])
    cost = (prompt - 8) * PRICES.input + 8 * PRICES.cached_input + 5 * PRICES.output  # type: ignore[operator]

    usage = messages[-1]["metadata"]["usage"]
    assert usage == {
        "promptTokens": prompt,
        "completionTokens": 5,
        "totalTokens": prompt + 5,
        "cachedTokens": 8,
        "cost": str(cost),
    }
    assert (fiber.input_tokens, fiber.output_tokens, fiber.cached_tokens, fiber.cost) == (prompt, 5, 8, cost)
    [step] = [e["payload"] for e in events if e["type"] == "chat:step:usage"]
    assert step == {
        "requestId": fiber.request_id,
        "step": 1,
        "inputTokens": prompt,
        "outputTokens": 5,
        "cachedTokens": 8,
        "cost": str(cost),
    }
    assert counter(MODEL_TOKENS, kind="input") - tokens_before["input"] == prompt
    assert counter(MODEL_TOKENS, kind="output") - tokens_before["output"] == 5
    assert counter(MODEL_TOKENS, kind="cached") - tokens_before["cached"] == 8
    assert counter(MODEL_COST) - cost_before == pytest.approx(float(cost))


async def test_a_model_without_a_price_records_tokens_and_no_cost(scripted_model: Any) -> None:
    _, fiber, messages = await run_turn("assistant", "count to 3")
    usage = messages[-1]["metadata"]["usage"]
    assert "cost" not in usage and usage["completionTokens"] == 3 and usage["cachedTokens"] == 0
    assert (fiber.output_tokens, fiber.cost) == (3, None)


async def test_a_recovery_over_its_token_budget_is_given_up_through_the_one_terminal_path(
    quiet_broker: dict[str, list[Any]],
) -> None:
    """The first run is the turn's own (not the recovery's); its continuation completes a step of 80
    tokens and is then cut off: over max_recovery_tokens (50), the recovery is exhausted with
    cost_budget_exceeded, the terminal message goes out and on_exhausted hears the reason."""
    agent = await sync_to_async(open_agent)("budget-agent", f"budget-{uuid.uuid4().hex[:8]}")
    cid = agent.conversation_id
    started = await db(
        turn_start_programmatic, conversation_id=cid, messages=["count to 300 [rate 50]"], enqueue=False
    )
    first = await interrupt(await Fiber.objects.aget(conversation_id=cid, request_id=started.request_id))
    await arecover_fiber(first.pk)
    [alarm_id] = quiet_broker["alarms"]
    sent = len(quiet_broker["turns"])
    await afire_alarm(alarm_id)
    [continuation_id] = quiet_broker["turns"][sent:]
    continuation = await Fiber.objects.aget(pk=continuation_id)
    # The continuation's first step ends (a tool call, say) and the runner records its spend, then dies.
    running = asyncio.ensure_future(turn_run(str(continuation.pk)))
    await wait_running(continuation)
    await db(fiber_spend_add, **spend_of(await Fiber.objects.aget(pk=continuation.pk), tokens=80))
    await cut_off(running)
    assert await take_released() == [continuation.pk]
    await arecover_fiber(continuation.pk)

    incident = await Incident.objects.aget(conversation_id=cid)
    assert (incident.status, incident.reason, incident.spent_tokens) == (
        "exhausted",
        "cost_budget_exceeded",
        80,
    )
    seen = [json.loads(v) for v in probe_redis().lrange(probe_key("exhausted", started.request_id), 0, -1)]
    assert [s["reason"] for s in seen] == ["cost_budget_exceeded"]
    terminal = (
        await Incident.objects.filter(pk=incident.pk).select_related("conversation").aget()
    ).conversation
    assert terminal.last_terminal["body"] == type(agent.agent).chat_recovery.terminal_message
    assert len(quiet_broker["turns"]) == sent + 1, "no further attempt was scheduled"


async def interrupt(fiber: Fiber) -> Fiber:
    running = asyncio.ensure_future(turn_run(str(fiber.pk)))
    await wait_running(fiber)
    await asyncio.sleep(0.2)
    await cut_off(running)
    assert await take_released() == [fiber.pk]
    return fiber


async def cut_off(running: asyncio.Future[Any]) -> None:
    """Cancel a running turn as a dying worker's shutdown does: it hands itself to recovery and the
    cancel goes on up. A turn that ended by itself first says why (the runner it returns)."""
    running.cancel()
    try:
        runner = await running
    except asyncio.CancelledError:
        return
    why = {key: getattr(runner, key, None) for key in ("stop_reason", "handed_over")}
    raise AssertionError(f"the turn was not running when it was cancelled: {why}")


async def wait_running(fiber: Fiber) -> None:
    for _ in range(200):
        if await Fiber.objects.filter(pk=fiber.pk, status=Fiber.Status.RUNNING).aexists():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the turn started")


def spend_of(fiber: Fiber, *, tokens: int) -> dict[str, Any]:
    return {
        "fiber_id": fiber.pk,
        "fencing": fiber.fencing,
        "input_tokens": tokens - 10,
        "output_tokens": 10,
        "cached_tokens": 0,
        "cost": None,
    }


def test_prices_and_an_agent_with_bad_ones_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="not a float"):
        ModelPrices(input=0.1, output=Decimal("0.1"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0 or more"):
        ModelPrices(input=Decimal("-1"), output=Decimal("0.1"))

    class Careless(Think):
        model_prices = {"input": 0.1}  # type: ignore[assignment]

    assert [e.id for e in Careless.check()] == ["think_chat.E032"]


def test_without_prices_of_its_own_a_step_is_priced_by_litellms_cost_map() -> None:
    import litellm

    from chat.turn.llm import Usage
    from chat.turn.pricing import step_cost

    usage = Usage(1000, 100, 1100, 200)
    prompt, completion = litellm.cost_per_token(
        model="gpt-4o-mini", prompt_tokens=1000, completion_tokens=100, cache_read_input_tokens=200
    )
    assert step_cost(None, "gpt-4o-mini", usage) == Decimal(str(prompt)) + Decimal(str(completion))
    assert step_cost(None, "no-such/model-anywhere", usage) is None
    assert step_cost(PRICES, "gpt-4o-mini", usage) == PRICES.cost(usage), "the agent's own prices win"
