"""What a turn spends, on the real stack: a worker runs a priced agent's turn through litellm to the
scripted model; the message's metadata, the fiber and the client's finish chunk carry the step's usage
and cost."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.models import Conversation
from recovery.models import Fiber
from tests.agents import PricedAgent
from tests.support import ChatClient, chat_request, user_message
from think_scripted.server import count_prompt_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def stored(name: str) -> list[dict[str, Any]]:
    from chat.transcript.selectors import messages_list

    return messages_list(conversation_id=Conversation.objects.get(agent="priced-agent", name=name).pk)


async def test_a_priced_turn_on_a_worker_records_its_usage_and_cost(stack: Any, scripted_model: Any) -> None:
    name = f"spend-{uuid.uuid4().hex[:8]}"
    async with ChatClient(stack.port, name, "priced-agent") as client:
        await client.send(chat_request("r-priced", [user_message(f"count to 4 [cached 6] {name}")]))
        log = await client.follow("r-priced", timeout=30)
    [finish] = [c for _, c in log.chunks if c["type"] == "finish"]
    [chat] = [m for m in scripted_model.chats if any(name in str(x.get("content")) for x in m)]
    prompt = count_prompt_tokens(chat)
    prices = PricedAgent.model_prices
    assert prices is not None and prices.cached_input is not None
    cost = (prompt - 6) * prices.input + 6 * prices.cached_input + 4 * prices.output
    usage = {"promptTokens": prompt, "completionTokens": 4, "totalTokens": prompt + 4, "cachedTokens": 6}
    assert finish["messageMetadata"]["usage"] == {**usage, "cost": str(cost)}
    assert (await sync_to_async(stored)(name))[-1]["metadata"]["usage"] == {**usage, "cost": str(cost)}
    fiber = await Fiber.objects.aget(request_id="r-priced", conversation__name=name)
    assert (fiber.input_tokens, fiber.output_tokens, fiber.cached_tokens, fiber.cost) == (prompt, 4, 6, cost)
