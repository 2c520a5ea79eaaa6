"""The session of an agent: compaction of a long history, the half that runs in a turn.

`Think.configure_session(session)` registers a compaction function with `session.on_compaction(fn)`;
`session.compact()` runs it and stores its result as an overlay (chat.transcript.compaction): the
summarised messages stay in Postgres, and every read of the transcript (the model's, the clients')
shows the summary in their place. `create_compact_function()` is a ready one: it keeps the head and a
recent tail and summarises the middle with the agent's own model.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from recovery.process.runtime import db, maybe_await

from ..models import Compaction
from ..transcript.compaction import (
    CompactionResult,
    TokenCounter,
    compaction_store,
    estimate_tokens,
    render_transcript,
    tail_start,
)
from ..transcript.selectors import messages_list
from ..types import UIMessage

if TYPE_CHECKING:
    from .agent import Think

logger = logging.getLogger(__name__)

SUMMARY_PROMPT = (
    "Summarize the conversation below so that the summary can replace it in an assistant's context. "
    "Keep facts, names, numbers, decisions, tool results and open questions. Be concise."
)

CompleteText = Callable[..., Awaitable[str]]


@dataclass(frozen=True)
class CompactionContext:
    agent: Think
    token_counter: TokenCounter
    # The model call a summariser makes: (model kwargs, chat messages) -> text (chat.turn.llm.complete_text).
    complete_text: CompleteText


CompactionFunction = Callable[[list[UIMessage], CompactionContext], Any]


class Session:
    def __init__(self, agent: Think, *, complete_text: CompleteText) -> None:
        self.agent = agent
        self.complete_text = complete_text
        self._compaction: CompactionFunction | None = None
        self.token_counter: TokenCounter = estimate_tokens

    def on_compaction(self, fn: CompactionFunction) -> CompactionFunction:
        """Register the compaction function: (messages, ctx) -> CompactionResult | None, sync or async."""
        if not callable(fn):
            raise TypeError(f"on_compaction needs a callable, got {fn!r}")
        self._compaction = fn
        return fn

    @property
    def can_compact(self) -> bool:
        return self._compaction is not None

    async def compact(self) -> Compaction | None:
        """Run the compaction function and store its overlay; None when it did not shorten anything."""

        if self._compaction is None:
            raise RuntimeError("no compaction function: call session.on_compaction(fn) in configure_session")
        conversation_id = self.agent._require_conversation()
        messages = await db(messages_list, conversation_id=conversation_id)
        try:
            context = CompactionContext(self.agent, self.token_counter, self.complete_text)
            result = await maybe_await(self._compaction(messages, context))
        except Exception:
            logger.exception("the compaction function raised; nothing was compacted")
            return None
        if result is None:
            return None
        if isinstance(result, dict):
            result = CompactionResult(**result)
        if not isinstance(result, CompactionResult) or not result.summary:
            logger.warning("the compaction function returned %r; nothing was compacted", result)
            return None
        return await db(compaction_store, conversation_id=conversation_id, result=result)


async def summarize_with_model(messages: list[UIMessage], ctx: CompactionContext) -> str:
    """The default summariser: the agent's own model, through litellm."""
    prompt = [
        {"role": "system", "content": SUMMARY_PROMPT},
        {"role": "user", "content": render_transcript(messages)},
    ]
    return await ctx.complete_text(model=ctx.agent.completion_kwargs(), messages=prompt)


def create_compact_function(
    *,
    summarize: Callable[[list[UIMessage], CompactionContext], Awaitable[str] | str] | None = None,
    protect_head: int = 3,
    tail_tokens: int = 20_000,
    min_tail_messages: int = 2,
) -> CompactionFunction:
    """Keep the first `protect_head` messages and a recent tail of about `tail_tokens`; summarise the rest.

    The tail starts at a user message, so a turn is never cut in two; a tool call and its result live in
    one part of one message, so they are never separated.
    """
    if protect_head < 0 or min_tail_messages < 1 or tail_tokens < 0:
        raise ValueError("protect_head >= 0, min_tail_messages >= 1 and tail_tokens >= 0 are required")
    summarizer = summarize or summarize_with_model

    async def compact(messages: list[UIMessage], ctx: CompactionContext) -> CompactionResult | None:
        tail = tail_start(messages, ctx.token_counter, protect_head, tail_tokens, min_tail_messages)
        middle = messages[protect_head:tail]
        if not middle:
            return None
        summary = await maybe_await(summarizer(middle, ctx))
        return CompactionResult(middle[0]["id"], middle[-1]["id"], str(summary))

    return compact
