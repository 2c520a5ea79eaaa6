"""The session of an agent: compaction of a long history into a summary overlay.

`Think.configure_session(session)` registers a compaction function with `session.on_compaction(fn)`;
`session.compact()` runs it and stores its result as an overlay: the summarised messages stay in
Postgres, and every read of the transcript (the model's, the clients') shows the summary in their place.
`create_compact_function()` is a ready one: it keeps the head and a recent tail and summarises the
middle with the agent's own model.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import transaction

from recovery.runtime import db

from ..models import Compaction, Conversation, Message
from .selectors import messages_list

if TYPE_CHECKING:
    from ..agents import Think

logger = logging.getLogger(__name__)

SUMMARY_PROMPT = (
    "Summarize the conversation below so that the summary can replace it in an assistant's context. "
    "Keep facts, names, numbers, decisions, tool results and open questions. Be concise."
)
COMPACTION_PREFIX = "compaction_"

UIMessage = dict[str, Any]
TokenCounter = Callable[[UIMessage], int]
CompleteText = Callable[..., Awaitable[str]]


@dataclass(frozen=True)
class CompactionResult:
    """Replace the messages from `from_message_id` to `to_message_id` (inclusive) with `summary`."""

    from_message_id: str
    to_message_id: str
    summary: str


@dataclass(frozen=True)
class CompactionContext:
    agent: Think
    token_counter: TokenCounter
    # The model call a summariser makes: (model kwargs, chat messages) -> text (chat.turn.llm.complete_text).
    complete_text: CompleteText


CompactionFunction = Callable[[list[UIMessage], CompactionContext], Any]


def estimate_tokens(message: UIMessage) -> int:
    """About four characters per token, over everything the model would read of the message."""
    return math.ceil(len(json.dumps(message.get("parts") or [], ensure_ascii=False)) / 4) + 4


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
            result = self._compaction(
                messages, CompactionContext(self.agent, self.token_counter, self.complete_text)
            )
            if inspect.isawaitable(result):
                result = await result
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


def real_message_id(conversation_id: int, message_id: str, end: str) -> str | None:
    """A message id of the raw transcript; a summary's id stands for the edge of the range it covers."""
    if message_id.startswith(COMPACTION_PREFIX):
        overlay = Compaction.objects.filter(
            conversation_id=conversation_id, compaction_id=message_id[len(COMPACTION_PREFIX) :]
        ).first()
        if overlay is None:
            return None
        return overlay.from_message_id if end == "from" else overlay.to_message_id
    exists = Message.objects.filter(conversation_id=conversation_id, message_id=message_id).exists()
    return message_id if exists else None


def compaction_store(*, conversation_id: int, result: CompactionResult) -> Compaction | None:
    """Store an overlay; overlays it covers (or extends) are replaced by it. None if the range is unknown."""
    with transaction.atomic():
        Conversation.objects.select_for_update().get(pk=conversation_id)
        start = real_message_id(conversation_id, result.from_message_id, "from")
        end = real_message_id(conversation_id, result.to_message_id, "to")
        if start is None or end is None:
            return None
        positions = dict(
            Message.objects.filter(conversation_id=conversation_id, message_id__in=[start, end]).values_list(
                "message_id", "position"
            )
        )
        low, high = positions[start], positions[end]
        if low > high:
            return None
        for overlay in Compaction.objects.filter(conversation_id=conversation_id):
            edges = Message.objects.filter(
                conversation_id=conversation_id,
                message_id__in=[overlay.from_message_id, overlay.to_message_id],
            ).values_list("position", flat=True)
            if edges and low <= min(edges) and max(edges) <= high:
                overlay.delete()
        return Compaction.objects.create(
            conversation_id=conversation_id,
            compaction_id=uuid.uuid4().hex,
            from_message_id=start,
            to_message_id=end,
            summary=result.summary,
        )


def render_transcript(messages: list[UIMessage]) -> str:
    """One line per message, as the summariser reads it."""
    lines = []
    for message in messages:
        pieces = []
        for part in message.get("parts") or []:
            if part.get("type") in ("text", "reasoning") and part.get("text"):
                pieces.append(str(part["text"]))
            elif str(part.get("type", "")).startswith("tool-") or part.get("type") == "dynamic-tool":
                name = part.get("toolName") or str(part.get("type"))[len("tool-") :]
                result = part.get("output", part.get("errorText"))
                pieces.append(f"[tool {name}({json.dumps(part.get('input'))}) -> {json.dumps(result)}]")
        text = " ".join(pieces).replace("\n", " ").strip()
        if text:
            lines.append(f"{message.get('role', 'user')}: {text}")
    return "\n".join(lines)


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
        tail = _tail_start(messages, ctx.token_counter, protect_head, tail_tokens, min_tail_messages)
        middle = messages[protect_head:tail]
        if not middle:
            return None
        summary = summarizer(middle, ctx)
        if inspect.isawaitable(summary):
            summary = await summary
        return CompactionResult(middle[0]["id"], middle[-1]["id"], str(summary))

    return compact


def _tail_start(
    messages: list[UIMessage], count: TokenCounter, protect_head: int, budget: int, minimum: int
) -> int:
    start, used = len(messages), 0
    while start > protect_head:
        cost = count(messages[start - 1])
        if len(messages) - start >= minimum and used + cost > budget:
            break
        used += cost
        start -= 1
    while protect_head < start < len(messages) and messages[start].get("role") != "user":
        start -= 1  # begin the tail at a user message
    return start
