"""The recovery engine: detection -> classification -> budget -> hook -> persist -> dispatch -> give-up.

`recover_fiber` handles one interrupted fiber; the continue and retry callbacks it
schedules run from alarms; `give_up` is the single exhaustion path. Everything runs on the
worker's event loop; database work hops to the DB threads.
"""

from __future__ import annotations

import copy
import inspect
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from chat import broadcast
from chat.agents import Think, agent_for
from chat.protocol import chat_messages_frame, recovering_frame, response_frame

from . import diagnostics
from .alarms import alarm_claim, alarm_schedule
from .context import ChatRecoveryContext, ChatRecoveryOptions
from .incident_store import incident_begin, incident_save, incident_set_status
from .incidents import (
    SCHEDULE_INITIAL,
    SCHEDULE_TRANSIENT,
    ChatRecovery,
    Incident,
    exhausted_context,
    incident_id_for,
    record_oom_and_decide,
    resolve_chat_recovery,
    schedule_is_idempotent,
    transient_wait_s,
)
from .models import Stream
from .recovery_state import (
    RecoveryTarget,
    conversation_set_recovering,
    conversation_set_terminal,
    fiber_mark_recovered,
    load_target,
    orphan_persist,
)
from .runtime import db

logger = logging.getLogger(__name__)

CONTINUE_CALLBACK = "chat_recovery_continue"
RETRY_CALLBACK = "chat_recovery_retry"
OOM_INTERRUPTIONS = frozenset({"worker_lost", "out_of_memory"})
# A model error the provider may not repeat (chat.errors): recovered after a wait, not at once.
TRANSIENT_INTERRUPTIONS = frozenset({"transient", "rate_limit"})
DECLINED_MESSAGE = "The turn was interrupted and automatic continuation was declined."


def now_ms() -> int:
    return int(time.time() * 1000)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@dataclass
class Recovery:
    """One interrupted fiber being handled: the loaded state plus the agent that owns it."""

    target: RecoveryTarget
    agent: Think
    config: ChatRecovery
    delay_s: float = 0.0  # before the continue or retry runs (after a transient model error)

    def emit(self, event_type: str, payload: dict[str, Any]) -> None:
        diagnostics.emit(event_type, payload, agent=self.agent.agent, name=self.agent.name)


def _event_payload(incident: Incident) -> dict[str, Any]:
    return {
        "incidentId": incident.incident_id,
        "requestId": incident.request_id,
        "attempt": incident.attempt,
        "maxAttempts": incident.max_attempts,
        "recoveryKind": incident.recovery_kind,
    }


async def _recovery_for(fiber_id: Any) -> Recovery | None:
    target = await db(load_target, fiber_id=fiber_id)
    if target is None:
        return None
    agent = agent_for(target.conversation.agent, target.conversation.name, target.conversation.pk)
    return Recovery(target, agent, resolve_chat_recovery(agent.chat_recovery))


async def recover_fiber(fiber_id: Any, *, retry_after_s: float | None = None) -> None:
    """Handle one interrupted fiber; an exception leaves it interrupted for a later tick.

    `retry_after_s`: how long the provider asked to wait, when a model error interrupted the turn.
    """
    recovery = await _recovery_for(fiber_id)
    if recovery is None:
        return
    target = recovery.target
    fiber_event = {
        "fiberId": str(fiber_id),
        "fiberName": f"__think_chat_turn:{target.request_id}",
        "requestId": target.request_id,
        "recoveryReason": "interrupted",
    }
    recovery.emit("fiber:run:interrupted", fiber_event)
    recovery.emit("fiber:recovery:detected", fiber_event)
    # The partial counts: a client tool call it holds is pending even before it is stored.
    partial = [target.partial.message()] if target.partial.has_content else None
    awaiting = await db(recovery.agent.has_pending_interaction, partial)
    evaluation = await db(
        incident_begin,
        conversation_id=target.conversation.pk,
        incident_id=incident_id_for(
            request_id=target.request_id,
            recovery_root_request_id=target.root_request_id,
            latest_user_message_id=target.latest_user_message_id,
        ),
        request_id=target.request_id,
        recovery_root_request_id=target.root_request_id,
        recovery_kind=target.kind,
        config=recovery.config,
        now_ms=now_ms(),
        awaiting=awaiting,
    )
    incident = evaluation.incident
    if evaluation.predicate_error is not None:
        logger.warning(
            "chat_recovery.should_keep_recovering raised; recovery continues: %r", evaluation.predicate_error
        )
    if evaluation.opened:
        recovery.emit("chat:recovery:detected", _event_payload(incident))
    recovery.emit("chat:recovery:attempt", _event_payload(incident))
    exhausted = evaluation.exhausted
    if not exhausted and target.fiber.interruption in OOM_INTERRUPTIONS:
        incident, exhausted = await _count_oom(recovery, incident)
    if exhausted:
        await _persist_orphan(recovery, keep=True)
        await give_up(recovery, incident)
    else:
        if target.fiber.interruption in TRANSIENT_INTERRUPTIONS:
            recovery.delay_s = transient_wait_s(incident, now_ms=now_ms(), retry_after_s=retry_after_s)
        await _recover(recovery, incident)
    await db(fiber_mark_recovered, fiber_id=fiber_id)
    recovery.emit("fiber:recovery:handled", {**fiber_event, "status": "internal"})


async def _count_oom(recovery: Recovery, incident: Incident) -> tuple[Incident, bool]:
    """A worker lost to memory spends the OOM budget; past it, the turn is sealed."""
    counted, exhausted = record_oom_and_decide(incident, config=recovery.config, now_ms=now_ms())
    assert counted is not None
    if exhausted:
        counted = replace(counted, status="exhausted", reason="out_of_memory")
    await db(incident_save, conversation_id=recovery.target.conversation.pk, incident=counted)
    return counted, exhausted


def _context(recovery: Recovery, incident: Incident) -> ChatRecoveryContext:
    target = recovery.target
    return ChatRecoveryContext(
        incident_id=incident.incident_id,
        recovery_root_request_id=target.root_request_id,
        attempt=incident.attempt,
        max_attempts=incident.max_attempts,
        recovery_kind=target.kind,
        stream_id=str(target.stream.pk) if target.stream is not None else "",
        request_id=target.request_id,
        partial_text=target.partial.text,
        # Copies: a hook that edits what it is given must not change what the engine persists.
        partial_parts=copy.deepcopy(target.partial.parts),
        recovery_data=target.recovery_data,
        messages=copy.deepcopy(target.messages),
        last_body=target.last_body,
        last_client_tools=target.last_client_tools,
        created_at=target.created_at_ms,
    )


async def _recover(recovery: Recovery, incident: Incident) -> None:
    target = recovery.target
    try:
        options = await maybe_await(recovery.agent.on_chat_recovery(_context(recovery, incident)))
    except Exception as exc:
        await db(
            incident_set_status,
            conversation_id=target.conversation.pk,
            incident_id=incident.incident_id,
            status="failed",
            reason=str(exc)[:64],
        )
        recovery.emit("chat:recovery:failed", {**_event_payload(incident), "reason": str(exc)})
        raise
    options = options if isinstance(options, ChatRecoveryOptions) else ChatRecoveryOptions()
    await _persist_orphan(recovery, keep=options.persist)
    await _dispatch(recovery, incident, options)


async def _persist_orphan(recovery: Recovery, *, keep: bool) -> None:
    """Settle a stream left open by the dead turn: store its partial (when allowed) and close it.

    Settled tool results are never dropped, whatever `keep` says (reference #1631).
    """
    target = recovery.target
    if target.stream is None or target.stream.status != Stream.Status.STREAMING:
        return
    persist = keep or target.partial.has_settled_tool_results
    target.messages = await db(orphan_persist, target=target, persist=persist)


async def _close_orphan_stream(recovery: Recovery, *, outcome: str, error: str | None = None) -> None:
    """Tell clients that watched the dead stream that it ended (its seq follows the last stored chunk)."""
    target = recovery.target
    if target.stream is None or not target.stream_was_open:
        return
    seq = target.last_seq + 1
    frame = response_frame(
        target.request_id,
        error or "",
        done=True,
        error=error is not None,
        seq=seq,
        continuation=target.stream.is_continuation,
        outcome=outcome,
    )
    await broadcast.publish_stream_end(target.conversation.pk, target.request_id, seq, frame)
    # After the end frame, as a turn's own finish does (chat.turns): clients take it as the truth.
    await broadcast.publish(target.conversation.pk, chat_messages_frame(target.messages))


async def _dispatch(recovery: Recovery, incident: Incident, options: ChatRecoveryOptions) -> None:
    target = recovery.target
    terminal = target.stream_terminal
    should_retry = target.kind == "retry" and options.continue_ and not terminal
    can_continue = not should_retry and options.continue_ and not terminal
    leaf = target.messages[-1] if target.messages else None
    data: dict[str, Any] = {
        "originalRequestId": target.root_request_id,
        "incidentId": incident.incident_id,
        "lastBody": target.last_body,
        "lastClientTools": target.last_client_tools,
    }
    if should_retry:
        data["targetUserId"] = target.latest_user_message_id
        await schedule_recovery(recovery, incident, RETRY_CALLBACK, data)
    elif can_continue:
        if leaf is not None and leaf["role"] == "assistant":
            data["targetAssistantId"] = leaf["id"]
            reattach = (target.fiber.snapshot or {}).get("reattach")
            # The provider kept generating what the dead turn streamed (model_reattach): the
            # continuation rejoins that generation after the last stored event, provided the leaf
            # holds everything up to that event (the dead turn's partial, or, when the dead turn
            # stored nothing, the partial its own recorded cursor came from).
            if reattach and (leaf["id"] == target.partial.message_id or not target.partial.has_content):
                data["reattach"] = reattach
        await schedule_recovery(recovery, incident, CONTINUE_CALLBACK, data)
    elif not options.continue_ and not terminal:
        await _skip(recovery, incident, "continue_disabled")
        await _record_terminal(recovery, target.request_id, DECLINED_MESSAGE)
        await _close_orphan_stream(recovery, outcome="error", error=DECLINED_MESSAGE)
        await _terminal(
            recovery, target.request_id, DECLINED_MESSAGE, broadcast_error=not target.stream_was_open
        )
        return
    else:
        await _skip(recovery, incident, "stream_terminal" if terminal else "not_recoverable")
    await _close_orphan_stream(
        recovery, outcome="recovering" if should_retry or can_continue else "completed"
    )


async def _skip(recovery: Recovery, incident: Incident, reason: str) -> None:
    await db(
        incident_set_status,
        conversation_id=recovery.target.conversation.pk,
        incident_id=incident.incident_id,
        status="skipped",
        reason=reason,
    )
    recovery.emit("chat:recovery:skipped", {**_event_payload(incident), "reason": reason})
    await _set_recovering(recovery.target.conversation.pk, None)


async def _set_recovering(conversation_id: int, request_id: str | None) -> None:
    """Flip the recovering flag and tell clients, only on a real transition."""
    changed = await db(conversation_set_recovering, conversation_id=conversation_id, request_id=request_id)
    if changed:
        await broadcast.publish(conversation_id, recovering_frame(request_id is not None, request_id))
        if request_id is None:  # clients parked on the recovery wait no more, unless a turn follows
            await broadcast.release_parked_if_idle(conversation_id)


async def schedule_recovery(
    recovery: Recovery, incident: Incident, callback: str, data: dict[str, Any]
) -> None:
    conversation_id = recovery.target.conversation.pk
    await db(
        incident_set_status,
        conversation_id=conversation_id,
        incident_id=incident.incident_id,
        status="scheduled",
    )
    await _set_recovering(conversation_id, recovery.target.root_request_id)
    delay_s = recovery.delay_s
    recovery.emit(
        "chat:recovery:scheduled",
        _event_payload(incident) | ({"delayMs": int(delay_s * 1000)} if delay_s else {}),
    )
    alarm = await db(
        alarm_schedule,
        conversation_id=conversation_id,
        callback=callback,
        payload=data,
        delay_s=delay_s,
        idempotent=schedule_is_idempotent(SCHEDULE_TRANSIENT if delay_s else SCHEDULE_INITIAL),
    )
    # An alarm due now fires at once rather than on the next tick (the row stays the durable copy);
    # a later one is the tick's.
    if not delay_s and await db(alarm_claim, alarm_id=alarm.pk):
        from .tasks import fire_alarm

        fire_alarm.delay(alarm.pk)


async def _record_terminal(recovery: Recovery, request_id: str, body: str) -> None:
    """Store the terminal outcome before any client hears of it, so a client that reconnects right after
    the error frame finds it (store, then broadcast)."""
    await db(
        conversation_set_terminal,
        conversation_id=recovery.target.conversation.pk,
        request_id=request_id,
        body=body,
    )


async def _terminal(recovery: Recovery, request_id: str, body: str, *, broadcast_error: bool = True) -> None:
    """The terminal outcome: an error frame now, and a record replayed to clients that connect later."""
    conversation_id = recovery.target.conversation.pk
    await db(conversation_set_terminal, conversation_id=conversation_id, request_id=request_id, body=body)
    if broadcast_error:
        await broadcast.publish(
            conversation_id, response_frame(request_id, body, done=True, error=True, outcome="error")
        )
    await _set_recovering(conversation_id, None)


async def give_up(recovery: Recovery, incident: Incident) -> None:
    """Exhaustion: event, on_exhausted (errors swallowed), terminal frame and record.

    The terminal message is never written into the transcript.
    """
    target = recovery.target
    sealed = incident if incident.status == "exhausted" else _sealed(incident, incident.reason)
    ctx = exhausted_context(
        sealed,
        config=recovery.config,
        stream_id=str(target.stream.pk) if target.stream else "",
        created_at=target.created_at_ms,
        partial_text=target.partial.text,
        partial_parts=target.partial.parts,
    )
    recovery.emit("chat:recovery:exhausted", dict(vars(ctx)))
    if recovery.config.on_exhausted is not None:
        try:
            await maybe_await(recovery.config.on_exhausted(ctx))
        except Exception:
            logger.exception("chat_recovery.on_exhausted raised; the terminal message is sent anyway")
    message = recovery.config.terminal_message
    await _record_terminal(recovery, ctx.request_id, message)
    await _close_orphan_stream(recovery, outcome="error", error=message)
    await _terminal(recovery, ctx.request_id, message, broadcast_error=not target.stream_was_open)
    await db(incident_save, conversation_id=target.conversation.pk, incident=sealed)


def _sealed(incident: Incident, reason: str | None) -> Incident:
    return replace(incident, status="exhausted", reason=reason or "max_attempts_exceeded")
