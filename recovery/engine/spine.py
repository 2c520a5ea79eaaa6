"""The recovery engine's spine: detection -> budget -> hook -> persist -> dispatch -> give-up.

`recover_fiber` handles one interrupted fiber against the recovery target its owner registered
(recovery.engine.targets): the target loads the fiber's state, answers the hook, stores the partial and starts
the continuation; the budget, the incident, the schedule of the recovery alarm and the give-up path are
the engine's. Everything runs on the worker's event loop; database work hops to the DB threads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from recovery.budget.incidents import (
    SCHEDULE_INITIAL,
    SCHEDULE_TRANSIENT,
    Incident,
    exhausted_context,
    incident_id_for,
    record_oom_and_decide,
    schedule_is_idempotent,
    transient_wait_s,
)
from recovery.engine import attempts
from recovery.engine.alarms import alarm_claim, alarm_schedule
from recovery.engine.context import ChatRecoveryOptions
from recovery.engine.store import incident_begin, incident_save, incident_set_status
from recovery.engine.targets import Interrupted, RecoveryTarget, recovery_target
from recovery.lease.fibers import FiberId, fiber_mark_recovered
from recovery.process import dispatch
from recovery.process.runtime import db, maybe_await

logger = logging.getLogger(__name__)

OOM_INTERRUPTIONS = frozenset({"worker_lost", "out_of_memory"})
# A model error the provider may not repeat: recovered after a wait, not at once.
TRANSIENT_INTERRUPTIONS = frozenset({"transient", "rate_limit"})


def now_ms() -> int:
    return int(time.time() * 1000)


def event_payload(incident: Incident) -> dict[str, Any]:
    return {
        "incidentId": incident.incident_id,
        "requestId": incident.request_id,
        "attempt": incident.attempt,
        "maxAttempts": incident.max_attempts,
        "recoveryKind": incident.recovery_kind,
        # What the recovery's interrupted attempts spent (the cost as a string: it is a Decimal).
        "spentTokens": incident.spent_tokens,
        "spentCost": str(incident.spent_cost) if incident.spent_cost is not None else None,
    }


async def arecover_fiber(fiber_id: FiberId, *, retry_after_s: float | None = None) -> None:
    """Handle one interrupted fiber; an exception leaves it interrupted for a later tick.

    `retry_after_s`: how long the provider asked to wait, when a model error interrupted the fiber.
    """
    target = recovery_target()
    work = await target.load(fiber_id)
    if work is None:
        return
    with attempts.attempt_span(work):
        await _handle(target, work, retry_after_s=retry_after_s)


async def _handle(target: RecoveryTarget, work: Interrupted, *, retry_after_s: float | None) -> None:
    fiber_id = work.fiber_id
    fiber_event = {
        "fiberId": str(fiber_id),
        "fiberName": target.fiber_name.format(request_id=work.request_id),
        "requestId": work.request_id,
        "recoveryReason": "interrupted",
    }
    work.emit("fiber:run:interrupted", fiber_event)
    work.emit("fiber:recovery:detected", fiber_event)
    awaiting = await target.awaiting(work)
    evaluation = await db(
        incident_begin,
        conversation_id=work.owner_id,
        incident_id=incident_id_for(
            request_id=work.request_id,
            recovery_root_request_id=work.root_request_id,
            latest_user_message_id=work.latest_user_message_id,
        ),
        request_id=work.request_id,
        recovery_root_request_id=work.root_request_id,
        recovery_kind=work.kind,
        config=work.config,
        now_ms=now_ms(),
        awaiting=awaiting,
        fiber_id=fiber_id,
    )
    if evaluation is None:  # a stop cancelled the fiber after it was loaded: nothing resumes
        work.emit("fiber:recovery:handled", {**fiber_event, "status": "stopped"})
        return
    incident = evaluation.incident
    attempts.attempt_incident(incident)
    if evaluation.predicate_error is not None:
        logger.warning(
            "chat_recovery.should_keep_recovering raised; recovery continues: %r", evaluation.predicate_error
        )
    if evaluation.opened:
        work.emit("chat:recovery:detected", event_payload(incident))
    work.emit("chat:recovery:attempt", event_payload(incident))
    exhausted = evaluation.exhausted
    if not exhausted and work.interruption in OOM_INTERRUPTIONS:
        incident, exhausted = await _count_oom(work, incident)
    if exhausted:
        await target.persist(work, keep=True)
        await give_up(work, incident)
    else:
        delay_s = 0.0
        if work.interruption in TRANSIENT_INTERRUPTIONS:
            delay_s = transient_wait_s(incident, now_ms=now_ms(), retry_after_s=retry_after_s)
        await _recover(work, incident, delay_s=delay_s)
    await db(fiber_mark_recovered, fiber_id=fiber_id)
    work.emit("fiber:recovery:handled", {**fiber_event, "status": "internal"})


async def _count_oom(work: Interrupted, incident: Incident) -> tuple[Incident, bool]:
    """A worker lost to memory spends the OOM budget; past it, the fiber is sealed."""
    counted, exhausted = record_oom_and_decide(incident, config=work.config, now_ms=now_ms())
    assert counted is not None
    if exhausted:
        counted = replace(counted, status="exhausted", reason="out_of_memory")
    await db(incident_save, conversation_id=work.owner_id, incident=counted)
    return counted, exhausted


async def _recover(work: Interrupted, incident: Incident, *, delay_s: float) -> None:
    target = recovery_target()
    try:
        options = await target.hook(work, incident)
    except Exception as exc:
        await db(
            incident_set_status,
            conversation_id=work.owner_id,
            incident_id=incident.incident_id,
            status="failed",
            reason=str(exc)[:64],
        )
        work.emit("chat:recovery:failed", {**event_payload(incident), "reason": str(exc)})
        attempts.attempt_outcome("failed", reason=str(exc)[:64])
        raise
    options = options if isinstance(options, ChatRecoveryOptions) else ChatRecoveryOptions()
    await target.persist(work, keep=options.persist)
    await target.dispatch(work, incident, options, delay_s=delay_s)


async def schedule(
    work: Interrupted, incident: Incident, callback: str, data: dict[str, Any], *, delay_s: float = 0.0
) -> bool:
    """Schedule the recovery alarm `callback` (registered by the owner) for `incident`, `delay_s` from now.

    False, and nothing scheduled, when a stop closed the incident while the engine handled it."""
    scheduled = await db(
        incident_set_status,
        conversation_id=work.owner_id,
        incident_id=incident.incident_id,
        status="scheduled",
    )
    if scheduled is None:
        attempts.attempt_outcome("stopped", callback=callback)
        return False
    await recovery_target().set_recovering(work.owner_id, work.root_request_id)
    attempts.attempt_outcome("scheduled", callback=callback, delay_ms=int(delay_s * 1000))
    work.emit(
        "chat:recovery:scheduled",
        event_payload(incident) | ({"delayMs": int(delay_s * 1000)} if delay_s else {}),
    )
    alarm = await db(
        alarm_schedule,
        conversation_id=work.owner_id,
        callback=callback,
        payload=data,
        delay_s=delay_s,
        idempotent=schedule_is_idempotent(SCHEDULE_TRANSIENT if delay_s else SCHEDULE_INITIAL),
    )
    # An alarm due now fires at once rather than on the next tick (the row stays the durable copy);
    # a later one is the tick's.
    if not delay_s and await db(alarm_claim, alarm_id=alarm.pk):
        dispatch.fire_later(alarm.pk)
    return True


async def skip(work: Interrupted, incident: Incident, reason: str) -> None:
    """Nothing is recovered: the incident is skipped and the recovering flag cleared."""
    await db(
        incident_set_status,
        conversation_id=work.owner_id,
        incident_id=incident.incident_id,
        status="skipped",
        reason=reason,
    )
    work.emit("chat:recovery:skipped", {**event_payload(incident), "reason": reason})
    attempts.attempt_outcome("skipped", reason=reason)
    await recovery_target().set_recovering(work.owner_id, None)


async def give_up(work: Interrupted, incident: Incident) -> None:
    """Exhaustion, the one terminal path: event, on_exhausted (errors swallowed), the owner's terminal
    outcome, the sealed incident."""
    sealed = incident if incident.status == "exhausted" else _sealed(incident, incident.reason)
    ctx = exhausted_context(
        sealed,
        config=work.config,
        stream_id=work.stream_id,
        created_at=work.created_at_ms,
        partial_text=work.partial_text,
        partial_parts=work.partial_parts,
    )
    work.emit("chat:recovery:exhausted", dict(vars(ctx)))
    attempts.attempt_outcome("exhausted", reason=sealed.reason)
    if work.config.on_exhausted is not None:
        try:
            await maybe_await(work.config.on_exhausted(ctx))
        except Exception:
            logger.exception("chat_recovery.on_exhausted raised; the terminal message is sent anyway")
    await recovery_target().end(work, request_id=ctx.request_id, message=work.config.terminal_message)
    await db(incident_save, conversation_id=work.owner_id, incident=sealed)


def _sealed(incident: Incident, reason: str | None) -> Incident:
    return replace(incident, status="exhausted", reason=reason or "max_attempts_exceeded")
