"""The chat app's recovery alarms: continue and retry, fired by the recovery layer's alarm table.

Registered in chat.apps. They wait for the conversation to be stable, park while a human is pending,
reschedule once per attempt when it is not stable, and otherwise start the continuation or the retry as
a new durable turn. The recovered turn settles the incident when it finishes (`settle_recovered_turn`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from django.db import transaction

from recovery.budget.incidents import (
    SCHEDULE_STABLE_TIMEOUT,
    STABLE_RETRY_DELAY_S,
    ChatRecovery,
    Incident,
    reschedule_after_stable_timeout,
    schedule_is_idempotent,
)
from recovery.engine import spine as recovery_engine
from recovery.engine.alarms import alarm_schedule
from recovery.engine.store import incident_cancelled, incident_get, incident_save, incident_set_status
from recovery.engine.targets import recovery_target
from recovery.exceptions import OperationRefused
from recovery.lease.fibers import fiber_request_cancel
from recovery.models import Alarm, Fiber
from recovery.models import Incident as IncidentRow
from recovery.observe import diagnostics
from recovery.process import runtime
from recovery.process.runtime import db

from ..exceptions import UnknownAgent
from ..models import Conversation
from ..transcript.completions import Ending, completion_record
from ..transcript.selectors import interaction_pending, messages_list
from ..transcript.snapshot import TurnKind, TurnSnapshot
from ..transcript.turns import await_stable, turn_start_recovered
from .agent import Think, recovery_config
from .interrupted import CONTINUE_CALLBACK, RETRY_CALLBACK, give_up_target
from .registry import agent_for

logger = logging.getLogger(__name__)

# How long an operator's give-up may take (it runs the agent's on_exhausted hook) before the caller
# stops waiting.
GIVE_UP_TIMEOUT_S = 60.0


class _Callback:
    def __init__(self, conversation: Conversation, data: dict[str, Any], callback: str) -> None:
        self.conversation = conversation
        self.data = data
        self.callback = callback
        self.agent: Think = agent_for(conversation.agent, conversation.name, conversation.pk)
        self.config: ChatRecovery = recovery_config(self.agent)
        self.incident_id: str = str(data.get("incidentId") or "")

    def emit(self, event_type: str, payload: dict[str, Any]) -> None:
        diagnostics.emit(event_type, payload, agent=self.agent.agent, name=self.agent.name)

    async def incident(self) -> Incident | None:
        if not self.incident_id:
            return None
        return await db(incident_get, conversation_id=self.conversation.pk, incident_id=self.incident_id)

    async def set_status(self, status: str, reason: str | None = None) -> None:
        record = await db(
            incident_set_status,
            conversation_id=self.conversation.pk,
            incident_id=self.incident_id,
            status=status,
            reason=reason,
        )
        if record is not None:
            payload = recovery_engine.event_payload(record) | ({"reason": reason} if reason else {})
            self.emit(f"chat:recovery:{status}", payload)
        if status in ("completed", "skipped", "failed"):
            await recovery_target().set_recovering(self.conversation.pk, None)

    async def run(self) -> None:
        stored = await self.incident()
        if stored is not None and stored.status == IncidentRow.Status.CANCELLED:
            return  # a stop closed it after this alarm was claimed: nothing of it resumes
        try:
            if not await await_stable(
                conversation_id=self.conversation.pk, timeout=self.config.stable_timeout_ms / 1000
            ):
                await self.not_stable()
                return
            await self.start_turn()
        except Exception:
            logger.exception("recovery callback %s failed; giving up", self.callback)
            await self.give_up("recovery_error")

    async def not_stable(self) -> None:
        if await db(interaction_pending, conversation_id=self.conversation.pk):
            # Park: a human is pending, which costs no budget; their answer resumes the turn (as a new
            # one: this turn ends here, with its answer waiting for them).
            await self.set_status("skipped", "awaiting_client_interaction")
            await self.turn_ended(Ending.RECOVERED)
            return
        incident = await self.incident()
        rescheduled = reschedule_after_stable_timeout(
            incident, config=self.config, now_ms=recovery_engine.now_ms()
        )
        if rescheduled is None:
            await self.give_up("stable_timeout")
            return
        await db(incident_save, conversation_id=self.conversation.pk, incident=rescheduled)
        await db(
            alarm_schedule,
            conversation_id=self.conversation.pk,
            callback=self.callback,
            payload=self.data,
            delay_s=STABLE_RETRY_DELAY_S,
            idempotent=schedule_is_idempotent(SCHEDULE_STABLE_TIMEOUT),
        )

    async def start_turn(self) -> None:
        messages = await db(messages_list, conversation_id=self.conversation.pk)
        leaf = messages[-1] if messages else None
        if self.callback == CONTINUE_CALLBACK:
            target = self.data.get("targetAssistantId")
            if target and (leaf is None or leaf["id"] != target):
                await self.set_status("skipped", "conversation_changed")
                await self.turn_ended(Ending.SKIPPED)
                return
            kind = TurnKind.CONTINUE
        else:
            if leaf is None or leaf["role"] != "user":
                await self.set_status("skipped", "no_unanswered_user_message")
                await self.turn_ended(Ending.SKIPPED)
                return
            if self.data.get("targetUserId") and leaf["id"] != self.data["targetUserId"]:
                await self.set_status("skipped", "conversation_changed")
                await self.turn_ended(Ending.SKIPPED)
                return
            kind = TurnKind.RETRY
        started = await db(
            turn_start_recovered,
            conversation_id=self.conversation.pk,
            kind=kind,
            root_request_id=str(self.data.get("originalRequestId") or ""),
            incident_id=self.incident_id or None,
            last_body=self.data.get("lastBody"),
            last_client_tools=self.data.get("lastClientTools"),
            reattach=self.data.get("reattach") if kind == TurnKind.CONTINUE else None,
            recovery_trace=self.data.get("trace"),
        )
        if started.status == "skipped":
            await self.set_status("skipped")
            if not await db(
                incident_cancelled, conversation_id=self.conversation.pk, incident_id=self.incident_id
            ):
                await self.turn_ended(Ending.SKIPPED)  # (a stop recorded its own end)

    async def turn_ended(self, ending: str) -> None:
        """The turn this recovery was for ends here, without a run of its own."""
        root = str(self.data.get("originalRequestId") or "")
        messages = await db(messages_list, conversation_id=self.conversation.pk)
        leaf = messages[-1] if messages else None
        answer = leaf["id"] if leaf is not None and leaf["role"] == "assistant" else None
        await db(_record_end, self.conversation.pk, root, ending, answer)

    async def give_up(self, reason: str) -> None:
        """The give-up spine of the callback path, guarded against a second banner."""
        stored = await self.incident()
        if stored is not None and stored.status in (
            IncidentRow.Status.EXHAUSTED,
            IncidentRow.Status.CANCELLED,
        ):
            return
        root = str(self.data.get("originalRequestId") or (stored.recovery_root_request_id if stored else ""))
        now = recovery_engine.now_ms()
        incident = stored or Incident(
            incident_id=self.incident_id or f"{root}:",
            request_id=root,
            recovery_root_request_id=root,
            recovery_kind="retry" if self.callback == RETRY_CALLBACK else "continue",
            attempt=self.config.max_attempts,
            max_attempts=self.config.max_attempts,
            status="exhausted",
            first_seen_at=now,
            last_attempt_at=now,
        )
        incident = replace(incident, status="exhausted", reason=reason)
        work = await db(give_up_target, conversation_id=self.conversation.pk, incident=incident)
        await recovery_engine.give_up(work.with_agent(self.agent), incident)


async def continue_alarm(conversation: Conversation, data: dict[str, Any]) -> None:
    await _Callback(conversation, data, CONTINUE_CALLBACK).run()


async def retry_alarm(conversation: Conversation, data: dict[str, Any]) -> None:
    await _Callback(conversation, data, RETRY_CALLBACK).run()


async def settle_recovered_turn(*, conversation: Conversation, incident_id: str, outcome: str) -> None:
    """A turn started by recovery finished: its incident is completed (and kept, as audit) or failed."""
    data = {"incidentId": incident_id}
    callback = _Callback(conversation, data, CONTINUE_CALLBACK)
    stored = await callback.incident()
    if stored is not None and stored.status == "exhausted":
        return  # given up meanwhile (an operator's "give up now"): that outcome stands
    if outcome == "completed":
        await callback.set_status("completed")
    elif outcome in ("error", "aborted"):
        await callback.set_status("failed", f"recovered turn {outcome}")


def _record_end(conversation_id: int, root: str, ending: str, message_id: str | None) -> None:
    with transaction.atomic():
        completion_record(
            conversation_id=conversation_id, request_id=root, ending=ending, message_id=message_id
        )


def _recovery_stop(incident: IncidentRow) -> None:
    """No recovery of a given-up incident may start later: its pending alarms go, its turns are cancelled."""
    Alarm.objects.filter(
        conversation_id=incident.conversation_id,
        callback__in=[CONTINUE_CALLBACK, RETRY_CALLBACK],
        status=Alarm.Status.PENDING,
        payload__incidentId=incident.incident_id,
    ).delete()
    chain = Fiber.objects.filter(
        conversation_id=incident.conversation_id, **{TurnSnapshot.lookup("incident_id"): incident.incident_id}
    ).active()
    for request_id in chain.values_list("request_id", flat=True):
        fiber_request_cancel(conversation_id=incident.conversation_id, request_id=request_id)


def give_up_now(incident: IncidentRow, *, reason: str) -> None:
    """An operator's give-up (sync): nothing of the incident resumes, then the callback path's give-up."""
    callback = RETRY_CALLBACK if incident.recovery_kind == "retry" else CONTINUE_CALLBACK
    data = {"incidentId": incident.incident_id, "originalRequestId": incident.recovery_root_request_id}
    conversation = Conversation.objects.get(pk=incident.conversation_id)
    try:
        handler = _Callback(conversation, data, callback)
    except UnknownAgent as exc:
        raise OperationRefused(f"{conversation}: {exc}") from None
    _recovery_stop(incident)
    runtime.run(handler.give_up(reason), timeout=GIVE_UP_TIMEOUT_S)
