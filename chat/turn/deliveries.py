"""The answer reaches whoever asked: `turn_completed` and `Think.on_turn_completed`, once per turn.

A turn's ending is recorded in the transaction that ended it (chat.transcript.completions); after the
commit the process that ended it delivers it here, on its event loop: claim the row, send the signal,
call the agent's hook, mark it delivered. The recovery tick's sweep delivers rows whose process died
before it could (their claim is stale after CLAIM_TTL). A deliverer that dies after the hooks ran and
before the mark is the one case where they run twice; `result.request_id` is stable, for receivers
that must deduplicate.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any

from recovery.process import runtime
from recovery.process.runtime import db

from ..exceptions import UnknownAgent
from ..models import TurnCompletion
from ..signals import turn_completed
from ..transcript.completions import (
    completion_claim,
    completion_delivered,
    completion_message,
    completions_due,
    completions_prune,
)
from ..types import UIMessage
from .agent import Think
from .registry import agent_class, agent_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnCompleted:
    """A turn's outcome, for `turn_completed` receivers and `on_turn_completed`."""

    agent: str
    name: str
    conversation_id: int
    request_id: str  # the turn's request id (what save_messages, submit_messages or the client used)
    ending: str  # completed, recovered, exhausted, cancelled, failed or skipped (TurnCompletion.Ending)
    message: UIMessage | None  # its answer as stored (None when it stored none)
    error: str = ""  # the terminal text of an exhausted or failed turn
    last_request_id: str = ""  # the request that ended it (a recovery's continuation, say)

    @property
    def text(self) -> str:
        message: UIMessage | dict[str, Any] = self.message or {}
        parts = message.get("parts") or []
        return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


def _result(completion: TurnCompletion) -> TurnCompleted:
    conversation = completion.conversation
    return TurnCompleted(
        agent=conversation.agent,
        name=conversation.name,
        conversation_id=conversation.pk,
        request_id=completion.request_id,
        ending=completion.ending,
        message=completion_message(completion),
        error=completion.error,
        last_request_id=completion.last_request_id,
    )


def _send_signal(sender: Any, result: TurnCompleted) -> None:
    for receiver, response in turn_completed.send_robust(sender=sender, result=result):
        if isinstance(response, BaseException):
            logger.error(
                "turn_completed receiver %r raised",
                receiver,
                exc_info=response,
                extra={"request_id": result.request_id},
            )


async def deliver(pk: int) -> bool:
    """Deliver one recorded ending (signal, then hook), unless someone else holds or delivered it."""
    completion = await db(completion_claim, pk=pk)
    if completion is None:
        return False
    result = await db(_result, completion)
    try:
        sender: Any = agent_class(result.agent)
    except UnknownAgent:
        sender = None
    await db(_send_signal, sender, result)
    if sender is not None:
        agent = agent_for(result.agent, result.name, result.conversation_id)
        try:
            if inspect.iscoroutinefunction(agent.on_turn_completed):
                await agent.on_turn_completed(result)
            else:  # a sync hook gets a database thread, as the receivers do
                await db(agent.on_turn_completed, result)
        except Exception:
            logger.exception("on_turn_completed raised", extra={"request_id": result.request_id})
    await db(completion_delivered, pk=pk)
    return True


def heard(agent: str) -> bool:
    """Whether anyone hears of this agent's turns: a turn_completed receiver (connected in every
    process, from an AppConfig.ready()), or the agent's own on_turn_completed."""
    try:
        cls = agent_class(agent)
    except UnknownAgent:
        return turn_completed.has_listeners()
    # The agent class is the signal's sender: a receiver connected for it alone counts too.
    return turn_completed.has_listeners(cls) or cls.on_turn_completed is not Think.on_turn_completed


def deliver_soon(ids: list[int]) -> None:
    """After the commit that recorded them: deliver on this process's loop, without waiting."""
    loop = runtime.get_loop()
    for pk in ids:
        asyncio.run_coroutine_threadsafe(_deliver_logged(pk), loop)


async def _deliver_logged(pk: int) -> None:
    try:
        await deliver(pk)
    except Exception:  # left for the sweep
        logger.exception("turn completion %s not delivered; the sweep will", pk)


# The tick prunes delivered rows once an hour (monotonic time of the last prune in this process).
PRUNE_EVERY_S = 3600.0
_pruned_at: float | None = None


def completions_sweep() -> int:
    """The recovery tick's sweep: deliver endings their process left undelivered (how many), and prune
    old delivered ones once an hour."""
    global _pruned_at
    now = time.monotonic()
    if _pruned_at is None or now - _pruned_at >= PRUNE_EVERY_S:
        _pruned_at = now
        completions_prune()
    delivered = 0
    for pk in completions_due():
        if runtime.run(deliver(pk), timeout=60):
            delivered += 1
    return delivered
