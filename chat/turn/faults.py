"""What clients see of an unexpected error, and where its details go.

A provider's error body can name internal hosts and URLs (a self-hosted model behind a proxy), and a
tool's exception can hold a connection string; neither is a client's to read. So an unexpected error of
a provider, a tool or the turn itself becomes a `recovery.models.Fault` row (class, full text,
traceback) and one log line with the same id, and clients, the stored transcript and the model (for a
tool) get a generic text naming the fault: "The model provider failed (error 3f2a9c1e)". A provider error
is named only by its class: a context window exceeded, a rate limit, a rejected request, a failure.

Texts meant for their reader are left as they are: a `ToolError`'s (a tool tells the model why on
purpose), validation and refusal messages, and whatever string an agent's `on_chat_error` returns.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from recovery.models import Fault, fault_reference
from recovery.operations.faults import fault_record
from recovery.process.runtime import db

from ..exceptions import ResponseFailed
from . import errors
from .overflow import CONTEXT_OVERFLOW
from .tools import ToolOutcome

logger = logging.getLogger(__name__)

# Modules whose exceptions are a model provider's answer (litellm maps every provider's errors to its own).
PROVIDER_MODULES = ("litellm", "openai", "httpx", "httpcore", "anthropic", "aiohttp")

PROVIDER_TEXTS = {
    CONTEXT_OVERFLOW: "The model provider rejected the request: context window exceeded",
    errors.RATE_LIMIT: "The model provider rejected the request: rate limited",
    "fatal": "The model provider rejected the request",
}
PROVIDER_FAILED = "The model provider failed"
TURN_FAILED = "The turn failed"
TOOL_FAILED = "The tool {name} failed"


def public(text: str, reference: str) -> str:
    return f"{text} (error {reference})"


def is_provider_error(error: BaseException) -> bool:
    """Whether the error, or one it wraps, came from the model provider (or the way to it)."""
    for current in errors.error_chain(error):
        if isinstance(current, ResponseFailed):
            return True
        if type(current).__module__.split(".")[0] in PROVIDER_MODULES:
            return True
    return False


def provider_text(error: BaseException, classification: str | None) -> str:
    """The provider error's class as a client may read it; never its body."""
    if classification == CONTEXT_OVERFLOW:
        return PROVIDER_TEXTS[CONTEXT_OVERFLOW]
    kind = errors.recoverable_kind(error) or ("fatal" if errors.is_refused(error) else None)
    return PROVIDER_TEXTS.get(kind or "", PROVIDER_FAILED)


async def fault_note(
    kind: str,
    error: BaseException,
    *,
    conversation_id: Any = None,
    fiber_id: Any = None,
    request_id: str = "",
    log_extra: dict[str, Any] | None = None,
) -> str:
    """Record the error as a fault and log it; the reference clients are shown. A fault that cannot be
    stored is still logged under its reference."""
    fault_id = uuid.uuid4()
    reference = fault_reference(fault_id)
    extra = {**(log_extra or {}), "fault_id": str(fault_id), "fault_kind": kind}
    # The traceback goes into the row, not the log: a handled error is not a crash (whose mark in a log
    # is a traceback; tests/e2e/test_frame_fuzz.py looks for them).
    logger.warning("%s fault %s: %s: %s", kind, reference, type(error).__name__, error, extra=extra)
    try:
        await db(
            fault_record,
            fault_id=fault_id,
            kind=kind,
            error=error,
            conversation_id=conversation_id,
            fiber_id=fiber_id,
            request_id=request_id,
        )
    except Exception as exc:
        logger.error("fault %s not stored (%s)", reference, exc, exc_info=error, extra=extra)
    return reference


async def turn_fault(
    error: BaseException, *, conversation_id: Any, fiber_id: Any, request_id: str, log_extra: dict[str, Any]
) -> tuple[str, str]:
    """A turn's error recorded as a fault: (its kind, the reference)."""
    kind = Fault.Kind.PROVIDER if is_provider_error(error) else Fault.Kind.TURN
    reference = await fault_note(
        kind,
        error,
        conversation_id=conversation_id,
        fiber_id=fiber_id,
        request_id=request_id,
        log_extra=log_extra,
    )
    return kind, reference


def turn_text(error: BaseException, classification: str | None, reference: str) -> str:
    """What clients see of a turn's error."""
    text = provider_text(error, classification) if is_provider_error(error) else TURN_FAILED
    return public(text, reference)


async def tool_failed(
    outcome: ToolOutcome, *, name: str, tool_call_id: str, agent: Any, request_id: str
) -> ToolOutcome:
    """A tool's unexpected exception, recorded as a fault; the outcome the model and client get."""
    error = outcome.failure
    if error is None:
        return outcome
    turn = getattr(agent, "turn", None)
    reference = await fault_note(
        Fault.Kind.TOOL,
        error,
        conversation_id=getattr(agent, "conversation_id", None),
        fiber_id=getattr(turn, "fiber_id", None),
        request_id=request_id,
        log_extra={"tool": name, "tool_call_id": tool_call_id, "request_id": request_id},
    )
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return ToolOutcome(error_text=public(TOOL_FAILED.format(name=name), reference), detail=detail)
