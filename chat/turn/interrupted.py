"""How a chat turn recovers: the chat app's recovery target (recovery.engine.targets), registered in
chat.apps.

The recovery layer's engine detects an interrupted fiber and spends its budget; this module reads what
the dead turn left (its snapshot, its stored stream, the transcript), asks the agent's
`on_chat_recovery`, stores the partial, chooses a continuation or a retry (run by the alarms of
chat.turn.continuation) and tells the clients how it ended.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, cast

from asgiref.sync import async_to_sync
from django.db import transaction
from django.utils import timezone

from recovery.budget.incidents import RECOVERING_FLAG_TTL_MS, ChatRecovery, Incident
from recovery.engine import spine as recovery_engine
from recovery.engine.context import ChatRecoveryContext, ChatRecoveryOptions
from recovery.engine.targets import RecoveryTarget
from recovery.lease.fibers import conversation_busy
from recovery.models import Fiber, Stream
from recovery.models import Incident as IncidentRow
from recovery.observe import diagnostics
from recovery.process.runtime import db, maybe_await
from recovery.stream.buffer import stream_close

from .. import broadcast
from ..models import Conversation
from ..protocol import recovering_frame, response_frame
from ..transcript.completions import Ending, completion_record
from ..transcript.finish import interactions_settle
from ..transcript.folding import MessageAccumulator
from ..transcript.interactions import foreign_updates_apply
from ..transcript.selectors import conversation_get, interaction_pending, messages_list, stream_partial
from ..transcript.services import message_place
from ..transcript.snapshot import FiberSnapshot, TurnSnapshot
from ..transcript.turns import CONTINUE_CALLBACK, RETRY_CALLBACK, RUN_TURN, turn_enqueue_pending
from ..types import Part, UIMessage
from . import tracing
from .agent import Think, recovery_config
from .registry import agent_for

DECLINED_MESSAGE = "The turn was interrupted and automatic continuation was declined."


@dataclass
class InterruptedTurn:
    """An interrupted chat turn: its fiber, the stream it left, the partial that stream makes, the
    transcript, and the agent that owns it (recovery.engine.targets.Interrupted)."""

    fiber: Fiber
    conversation: Conversation
    snapshot: TurnSnapshot | None
    recovery_data: Any
    stream: Stream | None
    partial: MessageAccumulator
    last_seq: int
    messages: list[UIMessage]
    agent: Think | None = None
    chat_recovery: ChatRecovery | None = None

    def emit(self, event_type: str, payload: dict[str, Any]) -> None:
        diagnostics.emit(event_type, payload, agent=self.conversation.agent, name=self.conversation.name)

    @property
    def config(self) -> ChatRecovery:
        assert self.chat_recovery is not None
        return self.chat_recovery

    @property
    def fiber_id(self) -> Any:
        return self.fiber.pk

    @property
    def owner_id(self) -> int:
        return self.conversation.pk

    @property
    def request_id(self) -> str:
        return self.fiber.request_id

    @property
    def interruption(self) -> str:
        return self.fiber.interruption

    @property
    def root_request_id(self) -> str:
        root = self.snapshot.recovery_root_request_id if self.snapshot is not None else ""
        return root if isinstance(root, str) and root else self.fiber.request_id

    @property
    def latest_user_message_id(self) -> str | None:
        value = self.snapshot.latest_user_message_id if self.snapshot is not None else None
        return value if isinstance(value, str) else None

    @property
    def stream_terminal(self) -> bool:
        return self.stream is not None and self.stream.status in (
            Stream.Status.COMPLETED,
            Stream.Status.ERROR,
        )

    @property
    def stream_was_open(self) -> bool:
        return self.stream is not None and not self.stream_terminal

    @property
    def stream_id(self) -> str:
        return str(self.stream.pk) if self.stream is not None else ""

    @property
    def partial_text(self) -> str:
        return self.partial.text

    @property
    def partial_parts(self) -> list[Part]:
        return self.partial.parts

    @property
    def kind(self) -> str:
        """retry when nothing was produced and the user message is unanswered, else continue.

        Unlike the reference, a stream that was opened but stayed empty is a retry too:
        a continuation would find the user message as the leaf and silently drop the turn.
        """
        snapshot = self.snapshot
        if snapshot is None or snapshot.continuation or self.stream_terminal:
            return "continue"
        leaf = self.messages[-1] if self.messages else None
        unanswered = (
            self.latest_user_message_id is not None
            and leaf is not None
            and leaf["role"] == "user"
            and leaf["id"] == self.latest_user_message_id
        )
        return "retry" if unanswered and not self.partial.has_content else "continue"

    @property
    def last_body(self) -> dict[str, Any] | None:
        return self.conversation.last_body if self.snapshot is None else self.snapshot.last_body

    @property
    def last_client_tools(self) -> list[dict[str, Any]] | None:
        if self.snapshot is None:
            return self.conversation.last_client_tools
        return self.snapshot.last_client_tools

    @property
    def created_at_ms(self) -> int:
        return int(self.fiber.created_at.timestamp() * 1000)

    @property
    def trace(self) -> Any:
        return FiberSnapshot.from_json(self.fiber.snapshot).trace

    def with_agent(self, agent: Think | None = None) -> InterruptedTurn:
        self.agent = agent or agent_for(self.conversation.agent, self.conversation.name, self.conversation.pk)
        self.chat_recovery = recovery_config(self.agent)
        return self


# --------------------------------------------------------------------------------------------------------
# Reads and small writes (sync, DB threads)
# --------------------------------------------------------------------------------------------------------


def load_target(*, fiber_id: Any) -> InterruptedTurn | None:
    """Load an interrupted fiber with its stream, partial and transcript; None if it is not interrupted."""
    fiber = (
        Fiber.objects.filter(pk=fiber_id, status=Fiber.Status.INTERRUPTED)
        .select_related("conversation")
        .first()
    )
    if fiber is None:
        return None
    stored = FiberSnapshot.from_json(fiber.snapshot)
    stream = Stream.objects.filter(fiber=fiber).order_by("-created_at").first()
    partial, last_seq = stream_partial(stream) if stream is not None else (MessageAccumulator(""), -1)
    return InterruptedTurn(
        fiber=fiber,
        conversation=fiber.conversation,
        snapshot=stored.turn,
        recovery_data=stored.stash,
        stream=stream,
        partial=partial,
        last_seq=last_seq,
        messages=messages_list(conversation_id=fiber.conversation_id),
    )


def give_up_target(*, conversation_id: int, incident: Incident) -> InterruptedTurn:
    """A synthetic target for a give-up with no interrupted fiber at hand: the newest stream of the turn."""
    conversation = Conversation.objects.get(pk=conversation_id)
    fiber = Fiber.objects.filter(conversation=conversation, request_id=incident.request_id).first()
    if fiber is None:
        fiber = Fiber(conversation=conversation, request_id=incident.request_id, created_at=timezone.now())
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
    return InterruptedTurn(
        fiber=fiber,
        conversation=conversation,
        snapshot=None,
        recovery_data=None,
        stream=open_stream,
        partial=partial,
        last_seq=last_seq,
        messages=messages_list(conversation_id=conversation_id),
    )


def orphan_persist(
    *, target: InterruptedTurn, persist: bool, status: str = Stream.Status.COMPLETED
) -> list[UIMessage]:
    """Store the partial under the stream's message id (if asked and non-empty) and close the stream."""
    assert target.stream is not None
    with transaction.atomic():
        Conversation.objects.select_for_update().filter(pk=target.conversation.pk).first()
        conversation = Conversation.objects.get(pk=target.conversation.pk)
        if not Stream.objects.filter(pk=target.stream.pk, status=Stream.Status.STREAMING).exists():
            # Settled meanwhile, under this lock: a stop of the conversation stored it (chat.transcript.stop).
            return messages_list(conversation_id=target.conversation.pk)
        if persist and target.partial.has_content:
            after = target.snapshot.latest_message_id if target.snapshot is not None else None
            message_place(
                conversation_id=conversation.pk, message=target.partial.message(), after_message_id=after
            )
        # Results of approved tools the dead turn ran belong to an earlier message: always kept.
        foreign_updates_apply(conversation_id=conversation.pk, updates=target.partial.foreign_tool_updates)
        interactions_settle(conversation)
        conversation.save(update_fields=["tool_updates", "continue_armed", "updated_at"])
        stream_close(stream_id=target.stream.pk, status=status)
    return messages_list(conversation_id=target.conversation.pk)


def recovering_flag_active(flag: Any, *, now_ms: int) -> bool:
    """A recovering flag older than RECOVERING_FLAG_TTL_MS is treated as absent."""
    if not isinstance(flag, dict):
        return False
    at = flag.get("at")
    return isinstance(at, int | float) and now_ms - at <= RECOVERING_FLAG_TTL_MS


def conversation_set_recovering(*, conversation_id: int, request_id: str | None) -> bool:
    """Set or clear the recovering flag; True when that changed it."""
    with transaction.atomic():
        conversation = Conversation.objects.select_for_update().get(pk=conversation_id)
        active = recovering_flag_active(conversation.recovering, now_ms=int(time.time() * 1000))
        if active == (request_id is not None):
            return False
        conversation.recovering = (
            {"requestId": request_id, "at": int(time.time() * 1000)} if request_id is not None else None
        )
        conversation.save(update_fields=["recovering", "updated_at"])
    return True


def conversation_set_terminal(
    *, conversation_id: int, request_id: str, body: str, completion: tuple[str, str, str | None] | None = None
) -> None:
    """Record the terminal outcome; with `completion` (root, ending, answer id), the turn's end too."""
    with transaction.atomic():
        Conversation.objects.filter(pk=conversation_id).update(
            last_terminal={"requestId": request_id, "body": body}
        )
        if completion is not None:
            root, ending, message_id = completion
            completion_record(
                conversation_id=conversation_id,
                request_id=root,
                last_request_id=request_id,
                ending=ending,
                message_id=message_id,
                error=body,
            )


def _answer_id(work: InterruptedTurn) -> str | None:
    """The message the dead turn stored (its partial, kept), or the transcript's assistant leaf."""
    if work.partial.has_content:
        return work.partial.message_id
    leaf = work.messages[-1] if work.messages else None
    return leaf["id"] if leaf is not None and leaf["role"] == "assistant" else None


def record_recovered_end(work: InterruptedTurn, ending: str) -> None:
    """Recovery ends the turn without a run of its own (the stream had finished; nothing to resume)."""
    with transaction.atomic():
        completion_record(
            conversation_id=work.conversation.pk,
            request_id=work.root_request_id,
            last_request_id=work.request_id,
            ending=ending,
            message_id=_answer_id(work),
        )


# --------------------------------------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------------------------------------


def _context(work: InterruptedTurn, incident: Incident) -> ChatRecoveryContext:
    return ChatRecoveryContext(
        incident_id=incident.incident_id,
        recovery_root_request_id=work.root_request_id,
        attempt=incident.attempt,
        max_attempts=incident.max_attempts,
        recovery_kind=work.kind,
        stream_id=work.stream_id,
        request_id=work.request_id,
        partial_text=work.partial.text,
        # Copies: a hook that edits what it is given must not change what the engine persists.
        partial_parts=copy.deepcopy(work.partial.parts),
        recovery_data=work.recovery_data,
        messages=cast(list[dict[str, Any]], copy.deepcopy(work.messages)),  # plain JSON to recovery
        last_body=work.last_body,
        last_client_tools=work.last_client_tools,
        created_at=work.created_at_ms,
    )


async def close_orphan_stream(work: InterruptedTurn, *, outcome: str, error: str | None = None) -> None:
    """Tell clients that watched the dead stream that it ended (its seq follows the last stored chunk)."""
    if work.stream is None or not work.stream_was_open:
        return
    seq = work.last_seq + 1
    frame = response_frame(
        work.request_id,
        error or "",
        done=True,
        error=error is not None,
        seq=seq,
        continuation=work.stream.is_continuation,
        outcome=outcome,
    )
    await broadcast.publish_stream_end(work.conversation.pk, work.request_id, seq, frame)
    # After the end frame, as a turn's own finish does (chat.turn.runner): clients take it as the truth.
    await broadcast.publish_transcript(work.conversation.pk)


class ChatTarget(RecoveryTarget):
    """Chat turns as the recovery layer's work."""

    fiber_name = "__think_chat_turn:{request_id}"

    task_name = RUN_TURN

    def enqueue_next(self, owner_id: int) -> None:
        turn_enqueue_pending(owner_id)

    async def load(self, fiber_id: Any) -> InterruptedTurn | None:
        work = await db(load_target, fiber_id=fiber_id)
        return None if work is None else work.with_agent()

    async def awaiting(self, work: Any) -> bool:
        # The partial counts: a client tool call it holds is pending even before it is stored.
        partial = [work.partial.message()] if work.partial.has_content else None
        assert work.agent is not None
        conversation_id = work.agent._require_conversation()
        return bool(await db(interaction_pending, conversation_id=conversation_id, extra=partial))

    async def hook(self, work: Any, incident: Incident) -> ChatRecoveryOptions | None:
        assert work.agent is not None
        options: ChatRecoveryOptions | None = await maybe_await(
            work.agent.on_chat_recovery(_context(work, incident))
        )
        return options

    async def persist(self, work: Any, *, keep: bool) -> None:
        """Settle a stream left open by the dead turn: store its partial (when allowed) and close it.

        Settled tool results are never dropped, whatever `keep` says: a tool must never run twice.
        """
        if work.stream is None or work.stream.status != Stream.Status.STREAMING:
            return
        persist = keep or work.partial.has_settled_tool_results
        work.messages = await db(orphan_persist, target=work, persist=persist)

    async def dispatch(
        self, work: Any, incident: Incident, options: ChatRecoveryOptions, *, delay_s: float
    ) -> None:
        terminal = work.stream_terminal
        should_retry = work.kind == "retry" and options.continue_ and not terminal
        can_continue = not should_retry and options.continue_ and not terminal
        leaf = work.messages[-1] if work.messages else None
        data: dict[str, Any] = {
            "originalRequestId": work.root_request_id,
            "incidentId": incident.incident_id,
            "lastBody": work.last_body,
            "lastClientTools": work.last_client_tools,
        }
        trace = tracing.recovery_trace(work)
        if trace is not None:  # the turn this recovery starts joins its trace (chat.turn.tracing)
            data["trace"] = trace
        if should_retry:
            data["targetUserId"] = work.latest_user_message_id
            if not await recovery_engine.schedule(work, incident, RETRY_CALLBACK, data, delay_s=delay_s):
                return  # a stop closed the incident meanwhile: it told the clients itself
        elif can_continue:
            if leaf is not None and leaf["role"] == "assistant":
                data["targetAssistantId"] = leaf["id"]
                reattach = FiberSnapshot.from_json(work.fiber.snapshot).cursor
                # The provider kept generating what the dead turn streamed (model_reattach): the
                # continuation rejoins that generation after the last stored event, provided the leaf
                # holds everything up to that event (the dead turn's partial, or, when the dead turn
                # stored nothing, the partial its own recorded cursor came from).
                if reattach and (leaf["id"] == work.partial.message_id or not work.partial.has_content):
                    data["reattach"] = reattach
            if not await recovery_engine.schedule(work, incident, CONTINUE_CALLBACK, data, delay_s=delay_s):
                return
        elif not options.continue_ and not terminal:
            await recovery_engine.skip(work, incident, "continue_disabled")
            await self.end(work, request_id=work.request_id, message=DECLINED_MESSAGE, ending=Ending.FAILED)
            return
        else:
            await recovery_engine.skip(work, incident, "stream_terminal" if terminal else "not_recoverable")
            await db(record_recovered_end, work, Ending.RECOVERED if terminal else Ending.SKIPPED)
        await close_orphan_stream(work, outcome="recovering" if should_retry or can_continue else "completed")

    async def end(self, work: Any, *, request_id: str, message: str, ending: str = Ending.EXHAUSTED) -> None:
        """The terminal outcome: stored before any client hears of it (a client that reconnects right
        after the error frame finds it), then the end of the dead stream or an error frame, and a record
        replayed to clients that connect later. It is never written into the transcript. The turn ends
        here (`ending`: recovery gave up, or was declined)."""
        conversation_id = work.conversation.pk
        await db(
            conversation_set_terminal,
            conversation_id=conversation_id,
            request_id=request_id,
            body=message,
            completion=(work.root_request_id, ending, _answer_id(work)),
        )
        await close_orphan_stream(work, outcome="error", error=message)
        if not work.stream_was_open:
            await broadcast.publish(
                conversation_id, response_frame(request_id, message, done=True, error=True, outcome="error")
            )
        await self.set_recovering(conversation_id, None)

    async def set_recovering(self, owner_id: int, request_id: str | None) -> None:
        changed = await db(conversation_set_recovering, conversation_id=owner_id, request_id=request_id)
        if changed:
            await broadcast.publish(owner_id, recovering_frame(request_id is not None, request_id))
            if request_id is None:  # clients parked on the recovery wait no more, unless a turn follows
                await broadcast.release_parked_if_idle(owner_id)

    def give_up(self, incident: IncidentRow, *, reason: str) -> None:
        from .continuation import give_up_now

        give_up_now(incident, reason=reason)

    def clear_recovering(self, owner_id: int) -> bool:
        changed = conversation_set_recovering(conversation_id=owner_id, request_id=None)
        # A flag past its TTL already counts as absent, so the service leaves it; an operator wants it gone.
        expired = Conversation.objects.filter(pk=owner_id, recovering__isnull=False).update(recovering=None)
        if not (changed or expired):
            return False
        broadcast.publish_sync(owner_id, recovering_frame(False))
        # As release_parked_if_idle does for the engine: parked clients wait no more unless a turn follows.
        if not conversation_busy(owner_id):
            async_to_sync(broadcast.release_parked)(owner_id)
        return True

    def owner_pk(self, *, agent: str, name: str) -> int | None:
        conversation = conversation_get(agent=agent, name=name)
        return None if conversation is None else conversation.pk

    def labels(self, owner: Any) -> dict[str, str]:
        return {"agent": owner.agent, "name": owner.name}
