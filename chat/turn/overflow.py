"""Context overflow: classifying a provider's "prompt too long" error, and the two recovery layers' settings.

Reactive: a turn rejected for overflowing the context window is compacted and run again under the same
request id, at most `max_retries` times, then ends with a terminal error. Proactive: before each model
step, the previous step's reported prompt tokens are compared with the budget and the history is
compacted in place when it is close.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from dataclasses import dataclass
from typing import Any

from recovery.observe import diagnostics

from .. import broadcast

logger = logging.getLogger(__name__)

CONTEXT_OVERFLOW = "context_overflow"
CLASSIFICATIONS = frozenset({"context_overflow", "rate_limit", "transient", "fatal", "unknown"})

# Anthropic, OpenAI, Google, Bedrock and Mistral wordings.
OVERFLOW_PATTERN = re.compile(
    r"prompt is too long|context[_ ]length[_ ]exceeded|maximum context length"
    r"|exceeds the maximum number of tokens|input token count|reduce the length of|input is too long"
    r"|too many (?:input )?tokens|context window",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Proactive:
    """Compact before a step whose previous step used `headroom` of `max_input_tokens` or more; with
    `before_first_step`, also before a turn's first model call when the history's estimated size (the
    session's token counter) does, so a long conversation is compacted before the provider refuses it."""

    max_input_tokens: int
    headroom: float = 0.9
    max_compactions: int = 1
    before_first_step: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_input_tokens, bool) or not isinstance(self.max_input_tokens, int):
            raise TypeError(f"Proactive.max_input_tokens must be an int, got {self.max_input_tokens!r}")
        if self.max_input_tokens <= 0:
            raise ValueError(f"Proactive.max_input_tokens must be > 0, got {self.max_input_tokens}")
        if not isinstance(self.headroom, int | float) or not 0 < self.headroom <= 1:
            raise ValueError(f"Proactive.headroom must be in (0, 1], got {self.headroom!r}")
        if isinstance(self.max_compactions, bool) or not isinstance(self.max_compactions, int):
            raise TypeError(f"Proactive.max_compactions must be an int, got {self.max_compactions!r}")
        if self.max_compactions < 1:
            raise ValueError(f"Proactive.max_compactions must be >= 1, got {self.max_compactions}")
        if not isinstance(self.before_first_step, bool):
            raise TypeError(f"Proactive.before_first_step must be a bool, got {self.before_first_step!r}")

    @property
    def threshold(self) -> float:
        return self.max_input_tokens * self.headroom


@dataclass(frozen=True)
class ContextOverflow:
    """Both layers are off unless asked for; both need a compaction function (`Think.compaction`)."""

    reactive: bool = False
    max_retries: int = 1
    proactive: Proactive | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reactive, bool):
            raise TypeError(f"ContextOverflow.reactive must be a bool, got {self.reactive!r}")
        if (
            isinstance(self.max_retries, bool)
            or not isinstance(self.max_retries, int)
            or self.max_retries < 0
        ):
            raise ValueError(f"ContextOverflow.max_retries must be an int >= 0, got {self.max_retries!r}")
        if self.proactive is not None and not isinstance(self.proactive, Proactive):
            raise TypeError(f"ContextOverflow.proactive must be a Proactive, got {self.proactive!r}")


@dataclass(frozen=True)
class ChatErrorContext:
    """Where an error happened, for `classify_chat_error` and `on_chat_error`."""

    stage: str  # "turn", "stream", "recovery"
    request_id: str | None = None
    messages_persisted: bool = True
    classification: str | None = None
    fault: str | None = None  # the reference of the fault recorded for it (chat.turn.faults), if any


def _error_text(error: Any) -> str:
    if isinstance(error, BaseException):
        return str(getattr(error, "message", None) or error)
    if isinstance(error, str):
        return error
    try:
        return json.dumps(error)
    except (TypeError, ValueError):
        return str(error)


def _is_litellm_overflow(error: Any) -> bool:
    exceptions = sys.modules.get("litellm.exceptions")  # never import litellm just to classify
    cls = getattr(exceptions, "ContextWindowExceededError", None) if exceptions else None
    return cls is not None and isinstance(error, cls)


class DefaultContextOverflowClassifier:
    """`classify_chat_error` that recognises context-window overflows of every litellm provider.

    A callable object rather than a function, so `classify_chat_error = default_context_overflow_classifier`
    in a class body is not turned into a method.
    """

    def __call__(self, error: Any, ctx: ChatErrorContext | None = None) -> str | None:
        if _is_litellm_overflow(error):
            return CONTEXT_OVERFLOW
        return CONTEXT_OVERFLOW if OVERFLOW_PATTERN.search(_error_text(error)) else None

    def __repr__(self) -> str:
        return "default_context_overflow_classifier"


default_context_overflow_classifier = DefaultContextOverflowClassifier()


def resolve_context_overflow(value: Any, owner: str) -> ContextOverflow | None:
    if value is None or isinstance(value, ContextOverflow):
        return value
    raise TypeError(f"{owner}.context_overflow must be a ContextOverflow or None, got {value!r}")


def classify(agent: Any, error: Any, *, stage: str, request_id: str | None) -> str | None:
    """The agent's classification of an error; a classifier that raises classifies nothing."""
    try:
        result = agent.classify_chat_error(error, ChatErrorContext(stage=stage, request_id=request_id))
    except Exception:
        logger.exception("classify_chat_error raised; the error is not classified")
        return None
    return result if result in CLASSIFICATIONS else None


async def compact_for_overflow(
    agent: Any, reason: str, *, request_id: str | None = None, attempt: int | None = None
) -> bool:
    """Compact the agent's session; True when it got shorter. Emits `chat:context:compacted` once."""

    session = agent.session
    if not session.can_compact:
        logger.warning("context overflow (%s) but no compaction function is registered", reason)
        return False
    shortened = await session.compact() is not None
    payload: dict[str, Any] = {"reason": reason, "shortened": shortened}
    if reason == "reactive":
        payload.update(requestId=request_id, attempt=attempt)
    diagnostics.emit("chat:context:compacted", payload, agent=agent.agent, name=agent.name)
    if shortened:  # clients see the summary in place of the compacted messages
        conversation_id = agent._require_conversation()
        await broadcast.publish_transcript(conversation_id)
    return shortened
