"""The scheduled recovery callbacks, fired from alarms.

They wait for the conversation to be stable, park while a human is pending, reschedule once per
attempt when it is not stable, and otherwise start the continuation or the retry as a new durable turn.
The recovered turn settles the incident when it finishes (see `settle_recovered_turn`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from django.utils import timezone

from chat import broadcast
from chat.agents import Think, agent_for
from chat.models import Conversation
from chat.protocol import recovering_frame
from chat.services import turn_start_recovered

from . import diagnostics
from .alarms import alarm_done, alarm_retry_later, alarm_schedule, register_callback, registered_callback
from .engine import (
    CONTINUE_CALLBACK,
    RETRY_CALLBACK,
    Recovery,
    _event_payload,
    give_up,
    now_ms,
)
from .incident_store import incident_get, incident_save, incident_set_status
from .incidents import (
    SCHEDULE_STABLE_TIMEOUT,
    STABLE_RETRY_DELAY_S,
    ChatRecovery,
    Incident,
    reschedule_after_stable_timeout,
    resolve_chat_recovery,
    schedule_is_idempotent,
)
from .models import Alarm, Fiber, Stream
from .recovery_state import RecoveryTarget, conversation_set_recovering
from .runtime import db

logger = logging.getLogger(__name__)


def _load_alarm(alarm_id: int) -> tuple[Alarm, Conversation] | None:
    alarm = (
        Alarm.objects.filter(pk=alarm_id, status=Alarm.Status.RUNNING).select_related("conversation").first()
    )
    return None if alarm is None else (alarm, alarm.conversation)


async def fire_alarm(alarm_id: int) -> None:
    """Run one claimed alarm; infrastructure errors put it back, anything else is handled by its callback."""
    loaded = await db(_load_alarm, alarm_id)
    if loaded is None:
        return
    alarm, conversation = loaded
    handler = registered_callback(alarm.callback)
    if handler is None:
        logger.error("alarm %s has unknown callback %r; dropped", alarm_id, alarm.callback)
        await db(alarm_done, alarm_id=alarm_id)
        return
    diagnostics.emit(
        "schedule:execute",
        {"callback": alarm.callback, "id": alarm_id},
        agent=conversation.agent,
        name=conversation.name,
    )
    try:
        await handler(conversation, dict(alarm.payload))
    except (OSError, ConnectionError) as exc:  # transient: keep the alarm and try again shortly
        diagnostics.emit(
            "schedule:retry",
            {"callback": alarm.callback, "id": alarm_id, "error": str(exc)},
            agent=conversation.agent,
            name=conversation.name,
        )
        await db(alarm_retry_later, alarm_id=alarm_id, delay_s=1)
        return
    await db(alarm_done, alarm_id=alarm_id)


class _Callback:
    def __init__(self, conversation: Conversation, data: dict[str, Any], callback: str) -> None:
        self.conversation = conversation
        self.data = data
        self.callback = callback
        self.agent: Think = agent_for(conversation.agent, conversation.name, conversation.pk)
        self.config: ChatRecovery = resolve_chat_recovery(self.agent.chat_recovery)
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
            payload = _event_payload(record) | ({"reason": reason} if reason else {})
            self.emit(f"chat:recovery:{status}", payload)
        if status in ("completed", "skipped", "failed"):
            await _clear_recovering(self.conversation.pk)

    async def run(self) -> None:
        try:
            if not await self.agent.await_stable(self.config.stable_timeout_ms / 1000):
                await self.not_stable()
                return
            await self.start_turn()
        except Exception:
            logger.exception("recovery callback %s failed; giving up", self.callback)
            await self.give_up("recovery_error")

    async def not_stable(self) -> None:
        if await db(self.agent.has_pending_interaction):
            # Park: a human is pending, which costs no budget; their answer resumes the turn.
            await self.set_status("skipped", "awaiting_client_interaction")
            return
        incident = await self.incident()
        rescheduled = reschedule_after_stable_timeout(incident, config=self.config, now_ms=now_ms())
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
        messages = await db(self.agent.messages)
        leaf = messages[-1] if messages else None
        if self.callback == CONTINUE_CALLBACK:
            target = self.data.get("targetAssistantId")
            if target and (leaf is None or leaf["id"] != target):
                await self.set_status("skipped", "conversation_changed")
                return
            kind = Fiber.Kind.CONTINUE
        else:
            if leaf is None or leaf["role"] != "user":
                await self.set_status("skipped", "no_unanswered_user_message")
                return
            if self.data.get("targetUserId") and leaf["id"] != self.data["targetUserId"]:
                await self.set_status("skipped", "conversation_changed")
                return
            kind = Fiber.Kind.RETRY
        started = await db(
            turn_start_recovered,
            conversation_id=self.conversation.pk,
            kind=kind,
            root_request_id=str(self.data.get("originalRequestId") or ""),
            incident_id=self.incident_id or None,
            last_body=self.data.get("lastBody"),
            last_client_tools=self.data.get("lastClientTools"),
            reattach=self.data.get("reattach") if kind == Fiber.Kind.CONTINUE else None,
        )
        if started.status == "skipped":
            await self.set_status("skipped")

    async def give_up(self, reason: str) -> None:
        """The give-up spine of the callback path, guarded against a second banner."""
        stored = await self.incident()
        if stored is not None and stored.status == "exhausted":
            return
        root = str(self.data.get("originalRequestId") or (stored.recovery_root_request_id if stored else ""))
        incident = stored or Incident(
            incident_id=self.incident_id or f"{root}:",
            request_id=root,
            recovery_root_request_id=root,
            recovery_kind="retry" if self.callback == RETRY_CALLBACK else "continue",
            attempt=self.config.max_attempts,
            max_attempts=self.config.max_attempts,
            status="exhausted",
            first_seen_at=now_ms(),
            last_attempt_at=now_ms(),
        )
        incident = replace(incident, status="exhausted", reason=reason)
        target = await db(_give_up_target, conversation_id=self.conversation.pk, incident=incident)
        await give_up(Recovery(target, self.agent, self.config), incident)


def _give_up_target(*, conversation_id: int, incident: Incident) -> RecoveryTarget:
    """A synthetic target for a give-up with no interrupted fiber at hand: the newest stream of the turn."""
    from chat.folding import MessageAccumulator
    from chat.selectors import messages_list, stream_partial

    conversation = Conversation.objects.get(pk=conversation_id)
    fiber = Fiber.objects.filter(conversation=conversation, request_id=incident.request_id).first() or Fiber(
        conversation=conversation, request_id=incident.request_id, created_at=timezone.now()
    )
    stream = (
        Stream.objects.filter(conversation=conversation, request_id=incident.request_id)
        .order_by("-created_at")
        .first()
    )
    open_stream = stream if stream is not None and stream.status == Stream.Status.STREAMING else None
    partial, last_seq = (
        stream_partial(open_stream)
        if open_stream is not None
        else (MessageAccumulator(stream.message_id if stream else ""), -1)
    )
    return RecoveryTarget(
        fiber=fiber,
        conversation=conversation,
        snapshot=None,
        recovery_data=None,
        stream=open_stream,
        partial=partial,
        last_seq=last_seq,
        messages=messages_list(conversation_id=conversation_id),
    )


async def _clear_recovering(conversation_id: int) -> None:
    if await db(conversation_set_recovering, conversation_id=conversation_id, request_id=None):
        await broadcast.publish(conversation_id, recovering_frame(False))
        await broadcast.release_parked_if_idle(conversation_id)


async def _continue(conversation: Conversation, data: dict[str, Any]) -> None:
    await _Callback(conversation, data, CONTINUE_CALLBACK).run()


async def _retry(conversation: Conversation, data: dict[str, Any]) -> None:
    await _Callback(conversation, data, RETRY_CALLBACK).run()


register_callback(CONTINUE_CALLBACK, _continue)
register_callback(RETRY_CALLBACK, _retry)


async def settle_recovered_turn(*, conversation: Conversation, incident_id: str, outcome: str) -> None:
    """A turn started by recovery finished: the incident is completed (record deleted) or failed."""
    data = {"incidentId": incident_id}
    callback = _Callback(conversation, data, CONTINUE_CALLBACK)
    stored = await callback.incident()
    if stored is not None and stored.status == "exhausted":
        return  # given up meanwhile (an operator's "give up now"): that outcome stands
    if outcome == "completed":
        await callback.set_status("completed")
    elif outcome in ("error", "aborted"):
        await callback.set_status("failed", f"recovered turn {outcome}")


__all__ = ["fire_alarm", "settle_recovered_turn"]
