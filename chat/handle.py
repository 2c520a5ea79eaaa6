"""Programmatic turns: `save_messages`, `continue_last_turn`, `chat()` and waiting for a turn's outcome.

Each starts a turn inside a fiber, exactly like a WebSocket turn, so a crash or a deploy is recovered
the same way. A turn's outcome follows its recovery chain: a turn that was interrupted and continued
ends with the outcome of the continuation that finished it.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import Q

from recovery.fibers import conversation_busy
from recovery.models import Alarm, Fiber, Incident

from .exceptions import ConversationBusy, ProtocolError
from .models import Conversation
from .turn.snapshot import TurnKind, TurnSnapshot
from .wire.protocol import validate_ui_message

FIBER_OUTCOMES: dict[str, str] = {
    Fiber.Status.COMPLETED: "completed",
    Fiber.Status.FAILED: "error",
    Fiber.Status.CANCELLED: "aborted",
}
POLL_S = 0.1

if TYPE_CHECKING:
    from .agents import ChunkCallback, Think

Messages = list[dict[str, Any]]
MessagesOrFunction = Messages | Callable[[Messages], Messages]


@dataclass(frozen=True)
class TurnResult:
    """A programmatic turn: its request id and status (`accepted` until waited for, then its outcome)."""

    request_id: str
    status: str  # accepted, completed, error, aborted or skipped


def ui_messages(value: Any) -> Messages:
    """Messages from user code: UIMessages (an id is added when missing) or plain strings (user text)."""
    if isinstance(value, str | dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a non-empty list of UIMessages or strings")
    messages = []
    for item in value:
        if isinstance(item, str):
            item = {"role": "user", "parts": [{"type": "text", "text": item}]}
        if not isinstance(item, dict):
            raise ValueError(f"a message must be a UIMessage dict or a string, got {type(item).__name__}")
        item = {"id": str(uuid.uuid4()), "parts": [], **item}
        try:
            messages.append(validate_ui_message(item))
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
    return messages


class _Busy(Exception):
    pass


def _lock_when_idle(conversation_id: int) -> Conversation:
    """Lock the conversation if no turn is queued or running; raises _Busy (inside a transaction)."""
    conversation = Conversation.objects.select_for_update().get(pk=conversation_id)
    if conversation_busy(conversation_id):
        raise _Busy  # rolls the transaction back and releases the lock: let that turn finish first
    return conversation


def turn_start_programmatic(
    *,
    conversation_id: int,
    messages: MessagesOrFunction,
    request_id: str | None = None,
    timeout: float | None = None,
    enqueue: bool = True,
    submission_id: str | None = None,
    on_applied: Callable[[Conversation], None] | None = None,
) -> TurnResult:
    """Append messages (or what a function of the current transcript returns) and start a turn.

    Waits until the conversation is free, so a function sees the transcript its turn will continue.
    """
    from recovery.fibers import fiber_create

    from .transcript.selectors import messages_list
    from .transcript.services import message_upsert, turn_enqueue, turn_snapshot

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            with transaction.atomic():
                conversation = _lock_when_idle(conversation_id)
                current = messages_list(conversation_id=conversation_id)
                new = ui_messages(messages(current) if callable(messages) else messages)
                for message in new:
                    message_upsert(conversation_id=conversation_id, message=message)
                request_id = request_id or str(uuid.uuid4())
                conversation.last_terminal = None
                conversation.save(update_fields=["last_terminal", "updated_at"])
                snapshot = turn_snapshot(conversation=conversation, request_id=request_id, continuation=False)
                fiber = fiber_create(
                    conversation_id=conversation_id,
                    request_id=request_id,
                    kind=TurnKind.PROGRAMMATIC,
                    snapshot=snapshot.replace(submission_id=submission_id).envelope(),
                )
                if on_applied is not None:
                    on_applied(conversation)
                if enqueue:
                    transaction.on_commit(
                        functools.partial(turn_enqueue, fiber_id=fiber.pk, conversation_id=conversation_id)
                    )
            return TurnResult(request_id, "accepted")
        except _Busy:
            if deadline is not None and time.monotonic() >= deadline:
                raise ConversationBusy(f"conversation {conversation_id} stayed busy for {timeout}s") from None
            time.sleep(POLL_S)


def chain_outcome(*, conversation_id: int, root_request_id: str) -> str | None:
    """The outcome of a turn and the recoveries that continued it; None while any of it may still run."""
    chain = Fiber.objects.filter(conversation_id=conversation_id).filter(
        Q(request_id=root_request_id)
        | Q(**{TurnSnapshot.lookup("recovery_root_request_id"): root_request_id})
    )
    if chain.filter(
        status__in=[Fiber.Status.PENDING, Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED]
    ).exists():
        return None
    alarms = Alarm.objects.filter(conversation_id=conversation_id, payload__originalRequestId=root_request_id)
    if alarms.exists():  # a continue or retry is scheduled (both kinds: a reference gap, #2276)
        return None
    last = chain.order_by("-created_at").first()
    if last is None:
        return "skipped"
    if last.status in FIBER_OUTCOMES:
        return FIBER_OUTCOMES[last.status]
    # Recovered and nothing followed: given up or declined (a terminal error), or nothing left to do.
    exhausted = Incident.objects.filter(
        conversation_id=conversation_id,
        recovery_root_request_id=root_request_id,
        status__in=[Incident.Status.EXHAUSTED, Incident.Status.FAILED],
    ).exists()
    terminal = Conversation.objects.values_list("last_terminal", flat=True).get(pk=conversation_id) or {}
    request_ids = set(chain.values_list("request_id", flat=True))
    return "error" if exhausted or terminal.get("requestId") in request_ids else "completed"


def turn_wait(*, conversation_id: int, request_id: str, timeout: float | None = None) -> TurnResult:
    """Block until the turn (and any recovery of it) has an outcome; raises TimeoutError."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        outcome = chain_outcome(conversation_id=conversation_id, root_request_id=request_id)
        if outcome is not None:
            return TurnResult(request_id, outcome)
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"turn {request_id} still running after {timeout}s")
        time.sleep(POLL_S)


@dataclass(frozen=True)
class ChatResult:
    """The outcome of `Think.chat()`: the turn's status and the assistant message it produced."""

    request_id: str
    status: str
    message: dict[str, Any] | None

    @property
    def text(self) -> str:
        parts = (self.message or {}).get("parts") or []
        return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


async def chat_run(
    agent: Think, messages: Any, *, on_chunk: ChunkCallback | None, timeout: float | None
) -> ChatResult:
    """Run a programmatic turn on this event loop; recovery takes over if this process dies."""
    from recovery.runtime import db

    from .transcript.selectors import messages_list
    from .turn.runner import turn_run

    conversation_id = agent._require_conversation()
    started = await db(
        turn_start_programmatic,
        conversation_id=conversation_id,
        messages=messages,
        timeout=timeout,
        enqueue=False,
    )
    fiber = await Fiber.objects.aget(conversation_id=conversation_id, request_id=started.request_id)
    runner = await turn_run(str(fiber.pk), on_chunk=on_chunk)
    if runner is not None and runner.outcome != "interrupted":
        message = runner.accumulator.message() if runner.accumulator.has_content else None
        return ChatResult(started.request_id, runner.outcome, message)
    # Taken by a worker, or handed to recovery (a stall): the outcome is the recovery chain's.
    result = await db(
        turn_wait, conversation_id=conversation_id, request_id=started.request_id, timeout=timeout
    )
    transcript = await db(messages_list, conversation_id=conversation_id)
    last = transcript[-1] if transcript and transcript[-1]["role"] == "assistant" else None
    return ChatResult(started.request_id, result.status, last)
