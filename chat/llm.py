"""The one module that talks to litellm: a streaming chat call turned into plain events.

litellm is imported lazily so that migrate, the admin and beat never pay for its import.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class StepFinish:
    finish_reason: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


Event = TextDelta | ReasoningDelta | ToolCallDelta | StepFinish | Usage


def load_litellm() -> Any:
    """Import litellm (seconds, the first time). Never call this on an event loop that runs turns."""
    # Without it litellm fetches its cost map over the network at import. Set here, not when this module
    # is imported, so a host process that never calls a model keeps its environment as it was.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True
    return litellm


async def _litellm() -> Any:
    # The first import takes seconds; on the loop it would starve every turn's heartbeat.
    if "litellm" in sys.modules:
        return load_litellm()
    return await asyncio.get_running_loop().run_in_executor(None, load_litellm)


def _events_of(chunk: Any) -> list[Event]:
    events: list[Event] = []
    for choice in getattr(chunk, "choices", None) or []:
        delta = getattr(choice, "delta", None)
        if delta is not None:
            reasoning = getattr(delta, "reasoning_content", None)
            if reasoning:
                events.append(ReasoningDelta(reasoning))
            if delta.content:
                events.append(TextDelta(delta.content))
            for call in getattr(delta, "tool_calls", None) or []:
                function = getattr(call, "function", None)
                events.append(
                    ToolCallDelta(
                        index=getattr(call, "index", 0) or 0,
                        id=getattr(call, "id", None),
                        name=getattr(function, "name", None) if function else None,
                        arguments=(getattr(function, "arguments", None) or "") if function else "",
                    )
                )
        if getattr(choice, "finish_reason", None):
            events.append(StepFinish(choice.finish_reason))
    usage = getattr(chunk, "usage", None)
    if usage is not None and getattr(usage, "total_tokens", None):
        events.append(Usage(usage.prompt_tokens or 0, usage.completion_tokens or 0, usage.total_tokens or 0))
    return events


async def stream_chat(
    *, model: dict[str, Any], messages: list[dict[str, Any]], **extra: Any
) -> AsyncGenerator[Event, None]:
    """Stream one model call. Provider errors surface as litellm exceptions (one retry budget: ours)."""
    litellm = await _litellm()
    kwargs = {"num_retries": 0, **model, **extra}
    response = await litellm.acompletion(
        messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    try:
        async for chunk in response:
            for event in _events_of(chunk):
                yield event
    finally:
        aclose = getattr(response, "aclose", None)
        if aclose is not None:
            await aclose()


async def complete_text(*, model: dict[str, Any], messages: list[dict[str, Any]], **extra: Any) -> str:
    """One non-streamed model call; its text (used to summarise a history)."""
    litellm = await _litellm()
    response = await litellm.acompletion(messages=messages, **{"num_retries": 0, **model, **extra})
    return str(response.choices[0].message.content or "")


def error_text(exc: BaseException) -> str:
    """A short human-readable text for a provider error."""
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return str(message)
