"""Writes: accepting turns, persisting messages, finishing turns, clearing conversations.

Every write that clients must hear about is followed by a broadcast after its transaction commits.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import F, Max
from django.utils import timezone

from recovery.exceptions import LeaseLost
from recovery.fibers import conversation_busy, fiber_create, fibers_fence_out, next_pending_fiber
from recovery.models import Fiber, Stream

from ..models import Compaction, Conversation, Message
from ..turn.snapshot import FiberSnapshot, TurnKind, TurnSnapshot
from ..wire.limits import turn_refusal
from ..wire.protocol import ChatRequest
from .compaction import COMPACTION_PREFIX
from .interactions import buffered_updates_apply, continuation_due, foreign_updates_apply

logger = logging.getLogger(__name__)


def conversation_get_or_create(*, agent: str, name: str, owner: str = "") -> Conversation:
    """The conversation (agent, name); a new one belongs to `owner` (an existing one keeps its owner)."""
    try:
        conversation, _ = Conversation.objects.get_or_create(
            agent=agent, name=name, defaults={"owner": owner}
        )
    except IntegrityError:  # two connections created it at once
        conversation = Conversation.objects.get(agent=agent, name=name)
    return conversation


def conversation_claim(*, conversation_id: int, owner: str) -> bool:
    """Give an unowned conversation to `owner`; True when it is (now or already) theirs."""
    Conversation.objects.filter(pk=conversation_id, owner="").update(owner=owner)
    return Conversation.objects.filter(pk=conversation_id, owner=owner).exists()


def _lock_conversation(conversation_id: int) -> Conversation:
    return Conversation.objects.select_for_update().get(pk=conversation_id)


def _next_position(conversation_id: int) -> int:
    current = Message.objects.filter(conversation_id=conversation_id).aggregate(m=Max("position"))["m"]
    return 0 if current is None else current + 1


def message_upsert(*, conversation_id: int, message: dict[str, Any]) -> Message:
    """Store a UIMessage: replace the one with this id, or append it. Call with the conversation locked."""
    existing = Message.objects.filter(conversation_id=conversation_id, message_id=message["id"]).first()
    if existing is not None:
        existing.parts = message.get("parts", [])
        existing.metadata = message.get("metadata")
        existing.save(update_fields=["parts", "metadata", "updated_at"])
        return existing
    return _message_create(conversation_id, message, _next_position(conversation_id))


def _message_create(conversation_id: int, message: dict[str, Any], position: int) -> Message:
    return Message.objects.create(
        conversation_id=conversation_id,
        message_id=message["id"],
        role=message["role"],
        parts=message.get("parts", []),
        metadata=message.get("metadata"),
        position=position,
    )


def message_place(*, conversation_id: int, message: dict[str, Any], after_message_id: str | None) -> Message:
    """Store a turn's message right after the message its turn answered, even if newer messages were
    queued meanwhile (a second request accepted while the first streamed). Call with the lock held."""
    known = Message.objects.filter(conversation_id=conversation_id, message_id=message["id"]).exists()
    anchor = (
        Message.objects.filter(conversation_id=conversation_id, message_id=after_message_id).first()
        if after_message_id and not known
        else None
    )
    if anchor is None:
        return message_upsert(conversation_id=conversation_id, message=message)
    later = Message.objects.filter(conversation_id=conversation_id, position__gt=anchor.position)
    later.update(position=F("position") + 1)
    return _message_create(conversation_id, message, anchor.position + 1)


def _reconcile(conversation_id: int, incoming: list[dict[str, Any]], trigger: str) -> None:
    """Merge the client's transcript into ours: the server is authoritative for messages it has.

    New messages are appended in order. On regenerate, the client has dropped the last assistant
    message, so stored messages after the last incoming one that we know are removed.
    """
    known = dict(
        Message.objects.filter(conversation_id=conversation_id).values_list("message_id", "position")
    )
    if trigger == "regenerate-message":
        anchor = max((known[m["id"]] for m in incoming if m["id"] in known), default=-1)
        Message.objects.filter(conversation_id=conversation_id, position__gt=anchor).delete()
    for message in incoming:
        # A compaction's summary message is a view, never stored (clients echo it back).
        if message["id"] not in known and not message["id"].startswith(COMPACTION_PREFIX):
            message_upsert(conversation_id=conversation_id, message=message)


def turn_snapshot(
    *,
    conversation: Conversation,
    request_id: str,
    continuation: bool,
    root_request_id: str | None = None,
    incident_id: str | None = None,
) -> TurnSnapshot:
    """The turn a fiber will run, taken before the model is called, so even a pre-stream crash is
    recoverable."""
    latest = Message.objects.filter(conversation=conversation).order_by("-position").first()
    latest_user = (
        Message.objects.filter(conversation=conversation, role=Message.Role.USER)
        .order_by("-position")
        .first()
    )
    return TurnSnapshot(
        request_id=request_id,
        continuation=continuation,
        recovery_root_request_id=root_request_id or request_id,
        latest_message_id=latest.message_id if latest else None,
        latest_message_role=latest.role if latest else None,
        latest_user_message_id=latest_user.message_id if latest_user else None,
        started_at=timezone.now().isoformat(),
        last_body=conversation.last_body,
        last_client_tools=conversation.last_client_tools,
        incident_id=incident_id,
    )


@dataclass(frozen=True)
class AcceptedTurn:
    fiber_id: Any
    request_id: str
    duplicate: bool = False
    dropped: bool = False  # the "drop" policy refused it while another turn was busy
    superseded: tuple[str, ...] = ()  # queued turns the "latest" policy cancelled for this one
    refused: str = ""  # why it was refused (a new message over the limits, a full queue); nothing stored


def turn_accept(*, conversation_id: int, request: ChatRequest, policy: str = "queue") -> AcceptedTurn:
    """Persist the client's new messages and create the turn's fiber; the worker is enqueued on commit.

    While another turn is queued or running, `policy` decides: "queue" runs this one after it (up to
    THINK["MAX_QUEUED_TURNS"] waiting turns), "latest" also cancels turns still waiting in the queue
    (their messages stay), "drop" refuses this one.
    """
    with transaction.atomic():
        conversation = _lock_conversation(conversation_id)
        existing = Fiber.objects.filter(conversation=conversation, request_id=request.id).first()
        if existing is not None:
            return AcceptedTurn(existing.pk, request.id, duplicate=True)
        busy = Fiber.objects.filter(conversation=conversation).active()
        refused = turn_refusal(conversation_id=conversation_id, request=request, busy=busy, policy=policy)
        if refused:
            return AcceptedTurn(None, request.id, refused=refused)
        if policy == "drop" and busy.exists():
            return AcceptedTurn(None, request.id, dropped=True)
        superseded: tuple[str, ...] = ()
        if policy == "latest":
            waiting = busy.filter(status=Fiber.Status.PENDING)
            superseded = tuple(waiting.values_list("request_id", flat=True))
            waiting.update(
                status=Fiber.Status.CANCELLED, finished_at=timezone.now(), fencing=F("fencing") + 1
            )
        _reconcile(conversation_id, request.messages, request.trigger)
        conversation.last_body = request.extra or None
        if request.client_tools is not None:
            conversation.last_client_tools = request.client_tools
        conversation.last_terminal = None
        conversation.save(update_fields=["last_body", "last_client_tools", "last_terminal", "updated_at"])
        snapshot = turn_snapshot(conversation=conversation, request_id=request.id, continuation=False)
        fiber = fiber_create(
            conversation_id=conversation_id,
            request_id=request.id,
            kind=TurnKind.CHAT,
            snapshot=snapshot.envelope(),
        )
        transaction.on_commit(lambda: turn_enqueue(fiber_id=fiber.pk, conversation_id=conversation_id))
    return AcceptedTurn(fiber.pk, request.id, superseded=superseded)


@dataclass(frozen=True)
class TurnStart:
    """The result of starting a programmatic turn: its request id, or status "skipped" (request id "")."""

    request_id: str
    status: str  # "accepted" or "skipped"
    fiber_id: Any = None


def turn_start_recovered(
    *,
    conversation_id: int,
    kind: str,
    root_request_id: str,
    incident_id: str | None,
    last_body: dict[str, Any] | None = None,
    last_client_tools: list[dict[str, Any]] | None = None,
    reattach: dict[str, Any] | None = None,
) -> TurnStart:
    """Start a continuation (leaf must be an assistant message) or a retry (leaf must be a user message).

    A continuation writes a new assistant message after the partial; a retry re-runs the model for the
    existing user message, which is never added twice. Skipped while another turn is queued or running.
    `reattach`: the provider cursor of the dead turn, for a continuation that rejoins its generation.
    """
    with transaction.atomic():
        conversation = _lock_conversation(conversation_id)
        return turn_start_followup(
            conversation=conversation,
            kind=kind,
            root_request_id=root_request_id,
            incident_id=incident_id,
            last_body=last_body,
            last_client_tools=last_client_tools,
            reattach=reattach,
        )


def turn_start_followup(
    *,
    conversation: Conversation,
    kind: str = TurnKind.CONTINUE,
    root_request_id: str = "",
    incident_id: str | None = None,
    last_body: dict[str, Any] | None = None,
    last_client_tools: list[dict[str, Any]] | None = None,
    require_idle: bool = True,
    owner_channel: str | None = None,
    reattach: dict[str, Any] | None = None,
) -> TurnStart:
    """Create the fiber of a continuation or retry; call inside a transaction holding the conversation lock.

    With `require_idle` False (an automatic continuation after tool results) the turn queues behind a
    running one instead of being skipped.
    """
    leaf = Message.objects.filter(conversation=conversation).order_by("-position").first()
    wanted = Message.Role.USER if kind == TurnKind.RETRY else Message.Role.ASSISTANT
    if leaf is None or leaf.role != wanted:
        return TurnStart("", "skipped")
    if require_idle and conversation_busy(conversation.pk):
        # Another turn was accepted meanwhile (or a second copy of this alarm already started one).
        return TurnStart("", "skipped")
    if last_body is not None or last_client_tools is not None:
        conversation.last_body = last_body if last_body is not None else conversation.last_body
        conversation.last_client_tools = (
            last_client_tools if last_client_tools is not None else conversation.last_client_tools
        )
        conversation.save(update_fields=["last_body", "last_client_tools", "updated_at"])
    request_id = str(uuid.uuid4())
    snapshot = turn_snapshot(
        conversation=conversation,
        request_id=request_id,
        continuation=kind != TurnKind.RETRY,
        root_request_id=root_request_id or None,
        incident_id=incident_id,
    ).replace(owner_channel=owner_channel)
    # The cursor goes where the turn's own segment writes keep it (recovery.stream).
    stored = snapshot.envelope(cursor=reattach)
    fiber = fiber_create(conversation_id=conversation.pk, request_id=request_id, kind=kind, snapshot=stored)
    conversation_id = conversation.pk
    transaction.on_commit(lambda: turn_enqueue(fiber_id=fiber.pk, conversation_id=conversation_id))
    return TurnStart(request_id, "accepted", fiber.pk)


def turn_enqueue(*, fiber_id: Any, conversation_id: int) -> None:
    """Hand a fiber to a worker, unless another turn of the conversation runs (it will start this one)."""
    from ..tasks import run_turn

    if next_pending_fiber(conversation_id=conversation_id) == fiber_id:
        run_turn.delay(str(fiber_id))


def turn_enqueue_pending(conversation_id: int) -> None:
    """How the recovery layer sends a conversation's head pending turn again (chat.turn.interrupted)."""
    turn_enqueue_next(conversation_id=conversation_id)


def turn_enqueue_next(*, conversation_id: int) -> None:
    from ..tasks import run_turn

    fiber_id = next_pending_fiber(conversation_id=conversation_id)
    if fiber_id is not None:
        run_turn.delay(str(fiber_id))


@dataclass(frozen=True)
class TurnOutcome:
    status: str  # a Fiber.Status
    stream_status: str  # a Stream.Status
    message: dict[str, Any] | None  # the assistant message to persist, if it has content
    terminal: str | None = None  # error text recorded for late reconnects
    # Tool outputs for calls of earlier messages (approved tools run by a continuation).
    foreign_updates: list[dict[str, Any]] = field(default_factory=list)


_FINISH_LOCK = "SELECT tool_updates, continue_armed FROM {conversation} WHERE id = %s FOR UPDATE"
_FIBER_FINISH = """
UPDATE {fiber} SET status = %(status)s, error = %(error)s, finished_at = now(), lease_expires_at = NULL,
    lease_owner = ''
WHERE id = %(fiber)s AND fencing = %(fencing)s AND status = 'running'
RETURNING request_id, snapshot
"""
_MESSAGE_UPDATE = """
UPDATE {message} SET parts = %(parts)s::jsonb, metadata = %(metadata)s::jsonb, updated_at = now()
WHERE conversation_id = %(conversation)s AND message_id = %(id)s
RETURNING id
"""
# A turn's message goes right after the message its turn answered, even if newer messages were queued
# meanwhile (a second request accepted while the first streamed); at the end when that one is gone.
_MESSAGE_PLACE = """
WITH anchor AS (
    SELECT position FROM {message} WHERE conversation_id = %(conversation)s AND message_id = %(after)s
), shift AS (
    UPDATE {message} SET position = position + 1
    WHERE conversation_id = %(conversation)s AND position > (SELECT position FROM anchor)
    RETURNING 1
)
INSERT INTO {message} (conversation_id, message_id, role, parts, metadata, position, created_at, updated_at)
VALUES (
    %(conversation)s, %(id)s, %(role)s, %(parts)s::jsonb, %(metadata)s::jsonb,
    COALESCE(
        (SELECT position FROM anchor) + 1,
        (SELECT COALESCE(max(position), -1) + 1 FROM {message} WHERE conversation_id = %(conversation)s)
    ),
    now(), now()
)
"""
_STREAM_CLOSE = "UPDATE {stream} SET status = %s, completed_at = now() WHERE id = %s AND status = 'streaming'"
_TERMINAL = "UPDATE {conversation} SET last_terminal = %s::jsonb, updated_at = now() WHERE id = %s"
# What follows the turn: the next queued turn, and whether submissions wait on this conversation.
_AFTER = """
SELECT (SELECT id FROM {fiber} WHERE conversation_id = %(conversation)s AND status = 'pending'
        AND NOT EXISTS (SELECT 1 FROM {fiber} WHERE conversation_id = %(conversation)s AND status = 'running')
        ORDER BY created_at LIMIT 1),
    EXISTS (SELECT 1 FROM {submission} WHERE conversation_id = %(conversation)s
            AND status IN ('pending', 'running'))
"""


def _tables() -> dict[str, str]:
    from ..models import Submission

    return {
        "conversation": Conversation._meta.db_table,
        "message": Message._meta.db_table,
        "fiber": Fiber._meta.db_table,
        "stream": Stream._meta.db_table,
        "submission": Submission._meta.db_table,
    }


def turn_finish(
    *, fiber_id: Any, fencing: int, conversation_id: int, stream_id: Any, outcome: TurnOutcome
) -> None:
    """Persist the assistant message and close stream and fiber in one transaction, fenced.

    Every turn pays for this, so its common case is a handful of plain statements; answers buffered
    while it ran (and the continuation they complete) take the ORM path of `interactions_settle`.
    """
    tables = _tables()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_FINISH_LOCK.format(**tables), [conversation_id])
        tool_updates, continue_armed = cursor.fetchone()
        finish = {
            "status": outcome.status,
            "error": outcome.terminal or "",
            "fiber": fiber_id,
            "fencing": fencing,
        }
        cursor.execute(_FIBER_FINISH.format(**tables), finish)
        finished = cursor.fetchone()
        if finished is None:
            raise LeaseLost(f"fiber {fiber_id} fencing {fencing}")
        request_id, turn = finished[0], FiberSnapshot.from_json(_json(finished[1])).turn
        if outcome.message is not None:
            after = turn.latest_message_id if turn is not None else None
            _message_store(cursor, tables, conversation_id, outcome.message, after)
        if outcome.foreign_updates:
            foreign_updates_apply(conversation_id=conversation_id, updates=outcome.foreign_updates)
        terminal = {"requestId": request_id, "body": outcome.terminal} if outcome.terminal else None
        if _json(tool_updates) or continue_armed:  # answers arrived meanwhile: apply them (ORM)
            conversation = Conversation.objects.get(pk=conversation_id)
            interactions_settle(conversation)
            conversation.last_terminal = terminal
            conversation.save(update_fields=["last_terminal", "tool_updates", "continue_armed", "updated_at"])
        else:
            cursor.execute(_TERMINAL.format(**tables), [json.dumps(terminal), conversation_id])
        if stream_id is not None:
            cursor.execute(_STREAM_CLOSE.format(**tables), [outcome.stream_status, stream_id])
        cursor.execute(_AFTER.format(**tables), {"conversation": conversation_id})
        pending, submissions = cursor.fetchone()
        root = turn.root_request_id if turn is not None else request_id
        transaction.on_commit(lambda: _turn_after(conversation_id, pending, submissions, root))


def _message_store(
    cursor: Any, tables: dict[str, str], conversation_id: int, message: dict[str, Any], after: str | None
) -> None:
    params = {
        "conversation": conversation_id,
        "id": message["id"],
        "role": message["role"],
        "parts": json.dumps(message.get("parts", [])),
        "metadata": json.dumps(message["metadata"]) if message.get("metadata") is not None else None,
        "after": after,
    }
    cursor.execute(_MESSAGE_UPDATE.format(**tables), params)  # a continuation's: the message it extends
    if cursor.fetchone() is None:
        cursor.execute(_MESSAGE_PLACE.format(**tables), params)


def _json(value: Any) -> Any:
    """A jsonb column read with a plain cursor (Django leaves its decoding to the model field)."""
    return json.loads(value) if isinstance(value, str | bytes) else value


def _turn_after(conversation_id: int, pending: Any, submissions: bool, root_request_id: str) -> None:
    """After a turn: start the next queued one; settle its submission and drain waiting ones."""
    from ..tasks import run_turn
    from .submissions import submission_turn_finished, submissions_drain

    if pending is not None:
        run_turn.delay(str(pending))
    if submissions:
        submission_turn_finished(conversation_id=conversation_id, root_request_id=root_request_id)
        submissions_drain(conversation_id=conversation_id)


def interactions_settle(conversation: Conversation) -> None:
    """Apply answers that arrived while the turn finished, and start the continuation they complete.

    Call with the conversation locked; the caller saves `tool_updates` and `continue_armed`.
    """
    buffered_updates_apply(conversation)
    leaf = Message.objects.filter(conversation=conversation).order_by("-position").first()
    if leaf is not None and continuation_due(conversation, leaf):
        conversation.continue_armed = ""
        turn_start_followup(conversation=conversation, require_idle=False)


def transcript_repair_save(
    *, fiber_id: Any, fencing: int, conversation_id: int, messages: list[dict[str, Any]]
) -> None:
    """Store repaired messages, only while the repairing turn still holds its fiber."""
    with transaction.atomic():
        _lock_conversation(conversation_id)
        if not Fiber.objects.filter(pk=fiber_id, fencing=fencing, status=Fiber.Status.RUNNING).exists():
            raise LeaseLost(f"fiber {fiber_id} fencing {fencing}")
        for message in messages:
            Message.objects.filter(conversation_id=conversation_id, message_id=message["id"]).update(
                parts=message.get("parts", []), updated_at=timezone.now()
            )


def conversation_clear(*, conversation_id: int) -> None:
    """Delete the transcript, stream buffers and request context; running turns are fenced out and
    open submissions skipped."""
    from .submissions import submissions_skip_all

    with transaction.atomic():
        conversation = _lock_conversation(conversation_id)
        fibers_fence_out(conversation_id=conversation_id)
        submissions_skip_all(conversation_id=conversation_id)
        Message.objects.filter(conversation=conversation).delete()
        Compaction.objects.filter(conversation=conversation).delete()
        Stream.objects.filter(conversation=conversation).delete()
        conversation.last_body = None
        conversation.last_client_tools = None
        conversation.last_terminal = None
        conversation.recovering = None
        conversation.tool_updates = []
        conversation.continue_armed = ""
        conversation.save(
            update_fields=[
                "last_body",
                "last_client_tools",
                "last_terminal",
                "recovering",
                "tool_updates",
                "continue_armed",
                "updated_at",
            ]
        )
