"""Accepting turns: a client's chat request, a programmatic turn, a continuation or a retry.

Each writes its messages, its fiber and the fiber's snapshot (chat.transcript.snapshot) in one
transaction, before the model is called, so even a turn that dies before its first chunk is recovered;
the worker is enqueued when that transaction commits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from celery import current_app
from django.db import connection, transaction
from django.utils import timezone

from recovery.engine.store import incident_cancelled, incident_mark_running
from recovery.lease.fibers import (
    conversation_busy,
    fiber_create,
    fiber_request_cancel,
    fibers_supersede_pending,
    next_pending_fiber,
)
from recovery.models import ACTIVE_STATUSES, Fiber
from recovery.process.runtime import db

from ..conf import frame_limits, think_setting
from ..exceptions import ConversationBusy, FileRefused, ProtocolError
from ..models import Conversation, Message
from ..protocol import ChatRequest, check_message_limits, validate_ui_message
from ..types import UIMessage
from .branches import tail_set_aside
from .compaction import COMPACTION_PREFIX
from .completions import Ending, completion_record, root_of
from .files import Attachments, attachments_resolve, files_store, principal_file_refusal
from .quotas import principal_refusal, principal_turn_counted
from .selectors import conversation_stable, json_column, messages_list
from .services import conversation_lock, conversation_request_save, message_upsert, messages_append
from .snapshot import TurnKind, TurnSnapshot
from .window import TRUNCATED_KEY

Edit = tuple[UIMessage, int]  # an edited user message, and the stored position of its id

RUN_TURN = "think.run_turn"  # the name of chat.tasks.run_turn, sent by name from here
# The recovery alarms that start a continuation or a retry (chat.turn.continuation); a stop deletes them.
CONTINUE_CALLBACK = "chat_recovery_continue"
RETRY_CALLBACK = "chat_recovery_retry"
POLL_S = 0.1

# Messages from user code (UIMessages, an id added when missing, or strings), or a function of the
# transcript that returns them.
Messages = list[dict[str, Any]]
MessagesOrFunction = Messages | Callable[[list[UIMessage]], Messages]


@dataclass(frozen=True)
class Turns:
    """A conversation's turns as an accept sees them (`_under_lock`): the fiber of the request being
    accepted, if it has one already, and how many others are queued and running."""

    existing: Any = None  # the request's own fiber (any status): the request came again
    pending: int = 0
    running: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.running)


# What an accept reads once it holds the conversation's lock, in one statement: the request's fiber and
# the conversation's queued and running ones, the stored positions of the request's message ids (a read
# the size of the request, not of the history: a client may hold only the newest messages of a long
# conversation), and the last position.
_UNDER_LOCK = """
SELECT
    (SELECT coalesce(json_agg(json_build_array(f.id, f.request_id, f.status)), '[]') FROM {fiber} f
     WHERE f.conversation_id = %(conversation)s
         AND (f.request_id = %(request)s OR f.status = ANY(%(active)s))),
    (SELECT coalesce(json_agg(json_build_array(m.message_id, m.position)), '[]') FROM {message} m
     WHERE m.conversation_id = %(conversation)s AND m.message_id = ANY(%(ids)s)),
    (SELECT max(m.position) FROM {message} m WHERE m.conversation_id = %(conversation)s)
"""


@dataclass(frozen=True)
class UnderLock:
    turns: Turns
    known: dict[str, int]  # the stored positions of the request's message ids
    last_position: int | None  # of the transcript's last message (None: it has none)


def _under_lock(conversation_id: int, request: ChatRequest) -> UnderLock:
    sql = _UNDER_LOCK.format(fiber=Fiber._meta.db_table, message=Message._meta.db_table)
    params: dict[str, Any] = {
        "conversation": conversation_id,
        "request": request.id,
        "active": list(ACTIVE_STATUSES),
        "ids": [message["id"] for message in request.messages],
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        fibers, known, last = cursor.fetchone()
    existing, statuses = None, Counter[str]()
    for pk, fiber_request, status in json_column(fibers):
        if fiber_request == request.id:
            existing = uuid.UUID(pk)
        else:
            statuses[status] += 1
    turns = Turns(existing, statuses[Fiber.Status.PENDING], statuses[Fiber.Status.RUNNING])
    return UnderLock(turns, dict(json_column(known)), last)


def turn_refusal(
    *,
    request: ChatRequest,
    turns: Turns,
    policy: str,
    client_history: bool,
    known: Collection[str],
    edit: Edit | None,
) -> str:
    """Why a chat request is refused ("" when it is not): a message it adds is not the client's to add,
    or is over the limits, or the conversation's queue is full, or it regenerates while a turn is queued
    or running (it would delete the messages that turn answers). Messages the server already has are
    echoes and not checked: the server wrote them itself (long answers, big tool outputs), and the
    stored ones stay as they are whatever the echo says. Call with the conversation locked: `known` (the
    stored ids among the request's), `edit` (`_edit_of`) and `turns` (`_under_lock`) were read under it."""
    limits = frame_limits()
    new = _new_messages(request.messages, known)
    most = think_setting("MAX_NEW_MESSAGES")
    if len(new) > most:
        return (
            f"it adds {len(new)} new messages, more than the {most} one request may add; send them in"
            " smaller requests"
        )
    for message in new:
        problem = None if client_history else client_message_problem(message)
        if problem is not None:
            return problem
        try:
            check_message_limits(message, limits)
        except ProtocolError as exc:
            return str(exc)
    if request.trigger == "regenerate-message" and turns.busy:
        return (
            "a turn is queued or running in this conversation; regenerate replaces the last answer, so stop"
            " that turn or wait for it first"
        )
    if edit is not None:
        problem = None if client_history else client_message_problem(edit[0])
        if problem is not None:
            return problem
        try:
            check_message_limits(edit[0], limits)
        except ProtocolError as exc:
            return str(exc)
        if turns.busy:
            return (
                "a turn is queued or running in this conversation; an edited message starts a new branch"
                " there, so stop that turn or wait for it first"
            )
    queued = think_setting("MAX_QUEUED_TURNS")
    if policy == "queue" and turns.pending >= queued:
        return f"{queued} turns are already queued in this conversation; send it when one has run"
    return ""


# Parts only the server writes: a user message carrying one would put words in the model's mouth.
SERVER_PARTS = ("tool-", "dynamic-tool", "reasoning", "step-start", "source-")


def client_message_problem(message: UIMessage) -> str | None:
    """Why a client may not add this message (None when it may): a client writes user messages, and only
    the parts a user writes (text, files, data); an assistant's, system's or tool's message, or a tool
    call or reasoning in a user's, is the server's to write."""
    role = message.get("role")
    if role != "user":
        return (
            f"message {message['id']!r} has role {role!r}: a client adds user messages only"
            " (tool results and approvals have frames of their own)"
        )
    for part in message.get("parts") or ():
        kind = str(part.get("type", "")) if isinstance(part, dict) else ""
        if kind.startswith(SERVER_PARTS):
            return f"message {message['id']!r} holds a {kind!r} part: only the server writes those"
    return None


def turn_snapshot(
    *,
    conversation: Conversation,
    request_id: str,
    continuation: bool,
    root_request_id: str | None = None,
    incident_id: str | None = None,
    appended: list[UIMessage] | None = None,
) -> TurnSnapshot:
    """The turn a fiber will run, taken before the model is called, so even a pre-stream crash is
    recoverable. `appended`: the messages the caller just added at the end of the transcript (under
    the lock), which tell the latest ones without reading them."""
    latest, latest_user = _latest_of(appended or [])
    # The ids and roles only: the latest message is often a long answer, its parts not needed here.
    messages = Message.objects.filter(conversation=conversation).order_by("-position")
    if latest is None:
        latest = messages.values_list("message_id", "role").first()
    if latest_user is None:
        latest_user = messages.filter(role=Message.Role.USER).values_list("message_id", flat=True).first()
    return TurnSnapshot(
        request_id=request_id,
        continuation=continuation,
        recovery_root_request_id=root_request_id or request_id,
        latest_message_id=latest[0] if latest else None,
        latest_message_role=latest[1] if latest else None,
        latest_user_message_id=latest_user,
        started_at=timezone.now().isoformat(),
        last_body=conversation.last_body,
        last_client_tools=conversation.last_client_tools,
        incident_id=incident_id,
    )


def _latest_of(appended: list[UIMessage]) -> tuple[tuple[str, str] | None, str | None]:
    """The latest message (id, role) and latest user message id among messages just appended, where
    they tell it (None where they do not)."""
    if not appended:
        return None, None
    latest = (appended[-1]["id"], appended[-1]["role"])
    users = [message["id"] for message in appended if message["role"] == Message.Role.USER]
    return latest, users[-1] if users else None


@dataclass(frozen=True)
class AcceptedTurn:
    fiber_id: Any
    request_id: str
    duplicate: bool = False
    dropped: bool = False  # the "drop" policy refused it while another turn was busy
    superseded: tuple[str, ...] = ()  # queued turns the "latest" policy cancelled for this one
    refused: str = ""  # why it was refused (a new message over the limits, a full queue); nothing stored
    ahead: int = 0  # turns of the conversation queued or running before it ("queue" policy): it waits


def turn_accept(
    *,
    conversation_id: int,
    request: ChatRequest,
    policy: str = "queue",
    client_history: bool = False,
    address: str | None = None,
    announce: Callable[[tuple[str, ...]], None] | None = None,
) -> AcceptedTurn:
    """Persist the client's new messages and create the turn's fiber; the worker is enqueued on commit.

    While another turn is queued or running, `policy` decides: "queue" runs this one after it (up to
    THINK["MAX_QUEUED_TURNS"] waiting turns), "latest" also cancels turns still waiting in the queue
    (their messages stay), "drop" refuses this one. A client adds user messages only, unless
    `client_history` (the agent's `accept_client_history`) lets it write any history. `address`, the
    client's, counts an anonymous visitor's turns (chat.transcript.quotas). `announce`, given the queued
    turns this one replaced, runs on commit before the turn is sent (chat.broadcast.
    accept_announcer), for an accepted turn only.
    """
    with transaction.atomic():
        conversation = conversation_lock(conversation_id)
        read = _under_lock(conversation_id, request)
        turns, known = read.turns, read.known
        if turns.existing is not None:
            return AcceptedTurn(turns.existing, request.id, duplicate=True)
        try:
            files = _request_files(conversation_id, request, known)
        except FileRefused as exc:
            return AcceptedTurn(None, request.id, refused=str(exc))
        request = dataclasses.replace(request, messages=files.messages)
        edit = _edit_of(conversation_id, request, known)  # of the request with its files' stored URLs
        refused = principal_refusal(conversation.owner, address=address) or turn_refusal(
            request=request,
            turns=turns,
            policy=policy,
            client_history=client_history,
            known=known,
            edit=edit,
        )
        if refused:
            return AcceptedTurn(None, request.id, refused=refused)
        if policy == "drop" and turns.busy:
            return AcceptedTurn(None, request.id, dropped=True)
        try:
            principal_file_refusal(conversation.owner, sum(len(f.data) for f in files.new), address=address)
        except FileRefused as exc:
            return AcceptedTurn(None, request.id, refused=str(exc))
        files_store(conversation_id, conversation.owner, files.new)
        superseded: tuple[str, ...] = ()
        if policy == "latest" and turns.pending:
            waiting = _waiting_turns(conversation_id)
            superseded = fibers_supersede_pending(conversation_id=conversation_id)
            for request_id in superseded:  # replaced before they ran: those turns end here
                root = root_of(request_id, waiting.get(request_id))
                completion_record(
                    conversation_id=conversation_id,
                    request_id=root,
                    last_request_id=request_id,
                    ending=Ending.SKIPPED,
                )
        appended = _reconcile(
            conversation_id,
            request.messages,
            request.trigger,
            known=known,
            edit=edit,
            last=read.last_position,
        )
        conversation.last_body = request.extra or None
        if request.client_tools is not None:
            conversation.last_client_tools = request.client_tools
        conversation.last_terminal = None
        conversation_request_save(
            conversation_id=conversation_id,
            last_body=conversation.last_body,
            last_client_tools=conversation.last_client_tools,  # the request's, else the last ones
        )
        snapshot = turn_snapshot(
            conversation=conversation, request_id=request.id, continuation=False, appended=appended
        )
        ahead = turns.running + turns.pending - len(superseded)
        fiber = fiber_create(
            conversation_id=conversation_id,
            request_id=request.id,
            kind=TurnKind.CHAT,
            snapshot=snapshot.envelope(),
        )
        principal_turn_counted(conversation.owner)
        fiber_id = fiber.pk
        if announce is not None:  # first: what other tabs are told must not come after the turn's stream
            transaction.on_commit(functools.partial(announce, superseded))
        if ahead:
            transaction.on_commit(lambda: turn_enqueue(fiber_id=fiber_id, conversation_id=conversation_id))
        else:  # nothing else queued or running, under the lock: it runs next, no need to look again
            transaction.on_commit(lambda: turn_send(fiber_id))
    return AcceptedTurn(fiber.pk, request.id, superseded=superseded, ahead=ahead)


def _request_files(conversation_id: int, request: ChatRequest, known: Collection[str]) -> Attachments:
    """The request's messages with the file parts of its own (new ones, an edited last one) pointing at
    stored files, and the files it brings (chat.transcript.files). No query without a file part."""
    if not any(
        isinstance(part, dict) and part.get("type") == "file"
        for message in request.messages
        for part in message.get("parts") or ()
    ):
        return Attachments(request.messages)
    check = {m["id"] for m in request.messages if m["id"] not in known}
    last = request.messages[-1]
    if last.get("role") == "user" and request.trigger == "submit-message":  # an edit, maybe (_edit_of)
        check.add(last["id"])
    return attachments_resolve(conversation_id, request.messages, check=check)


def _new_messages(incoming: list[UIMessage], known: Collection[str]) -> list[UIMessage]:
    """The messages of a request the server does not have, one per id (the last copy of an id wins).
    Clients echo the whole transcript with each request: only these are the request's own; a
    compaction's summary message is a view, never stored (clients echo it back)."""
    new = {
        message["id"]: message
        for message in incoming
        if message["id"] not in known and not message["id"].startswith(COMPACTION_PREFIX)
    }
    return list(new.values())


def _edit_of(conversation_id: int, request: ChatRequest, known: Collection[str]) -> Edit | None:
    """An edit: a submitted request whose last message is a stored user message with other parts (the
    AI SDK's `sendMessage({text, messageId})`). That message and its stored position; None otherwise.
    A message cut for display (its echo differs from what is stored) is never taken for an edit.
    `known`: the stored ids among the request's (a new message is no edit, and costs no read)."""
    if request.trigger != "submit-message" or not request.messages:
        return None
    last = request.messages[-1]
    if last["id"] not in known or last.get("role") != "user" or TRUNCATED_KEY in (last.get("metadata") or {}):
        return None
    stored = (
        Message.objects.filter(conversation_id=conversation_id, message_id=last["id"], role=Message.Role.USER)
        .values_list("parts", "position")
        .first()
    )
    if stored is None or stored[0] == last.get("parts"):
        return None
    return last, stored[1]


def _reconcile(
    conversation_id: int,
    incoming: list[UIMessage],
    trigger: str,
    *,
    known: dict[str, int],
    edit: Edit | None,
    last: int | None,
) -> list[UIMessage]:
    """Merge the client's transcript into ours: the server is authoritative for messages it has.

    New messages are appended in order. On regenerate, the client has dropped the last assistant
    message: what follows the last incoming one we know is set aside as a branch (chat.transcript.
    branches). An edited user message sets itself and what followed it aside the same way, and the new
    version takes its place. `known`: the stored positions of the incoming ids (`_under_lock`), read
    before anything was added; `edit`: `_edit_of` the request; `last`: the last stored position (None:
    no message), read under the same lock. Returns the messages it appended.
    """
    known = dict(known)
    moved = trigger == "regenerate-message" or edit is not None  # a tail set aside: positions changed
    if trigger == "regenerate-message":
        anchor = max((known[m["id"]] for m in incoming if m["id"] in known), default=None)
        if anchor is None:  # it knows none of ours (a window of one cut message): re-answer the last user's
            anchor = _last_user_position(conversation_id)
        tail_set_aside(conversation_id=conversation_id, after_position=anchor)
    if edit is not None:
        tail_set_aside(conversation_id=conversation_id, after_position=edit[1] - 1)
        known.pop(edit[0]["id"], None)
    appended = _new_messages(incoming, known)
    first = None if moved else (0 if last is None else last + 1)  # None: read after the set-aside
    messages_append(conversation_id=conversation_id, messages=appended, first=first)
    return appended


def _last_user_position(conversation_id: int) -> int:
    last = Message.objects.filter(conversation_id=conversation_id, role=Message.Role.USER).order_by(
        "-position"
    )
    position = last.values_list("position", flat=True).first()
    return position if position is not None else -1


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
    recovery_trace: dict[str, Any] | None = None,
) -> TurnStart:
    """Start a continuation (leaf must be an assistant message) or a retry (leaf must be a user message).

    A continuation writes a new assistant message after the partial; a retry re-runs the model for the
    existing user message, which is never added twice. Skipped while another turn is queued or running.
    `reattach`: the provider cursor of the dead turn, for a continuation that rejoins its generation.
    `recovery_trace`: the trace contexts its span continues (TurnSnapshot.recovery_trace).
    """
    with transaction.atomic():
        conversation = conversation_lock(conversation_id)
        return turn_start_followup(
            conversation=conversation,
            kind=kind,
            root_request_id=root_request_id,
            incident_id=incident_id,
            last_body=last_body,
            last_client_tools=last_client_tools,
            reattach=reattach,
            recovery_trace=recovery_trace,
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
    recovery_trace: dict[str, Any] | None = None,
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
    if incident_id and incident_cancelled(conversation_id=conversation.pk, incident_id=incident_id):
        # A stop closed the incident (chat.transcript.stop, under this same lock): nothing of it resumes.
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
    ).replace(owner_channel=owner_channel, recovery_trace=recovery_trace)
    # The cursor goes where the turn's own segment writes keep it (recovery.stream.buffer).
    stored = snapshot.envelope(cursor=reattach)
    fiber = fiber_create(conversation_id=conversation.pk, request_id=request_id, kind=kind, snapshot=stored)
    conversation_id = conversation.pk
    if incident_id:
        # In this transaction, so the turn's own end (completed, failed) can never be overwritten by it.
        incident_mark_running(conversation_id=conversation_id, incident_id=incident_id)
    transaction.on_commit(lambda: turn_enqueue(fiber_id=fiber.pk, conversation_id=conversation_id))
    return TurnStart(request_id, "accepted", fiber.pk)


def _waiting_turns(conversation_id: int, **only: Any) -> dict[str, Any]:
    """The queued fibers of a conversation, locked: request id -> snapshot."""
    waiting = Fiber.objects.select_for_update().filter(
        conversation_id=conversation_id, status=Fiber.Status.PENDING, **only
    )
    return dict(waiting.values_list("request_id", "snapshot"))


def turn_cancel(*, conversation_id: int, request_id: str) -> bool:
    """Cancel a request's turn: a queued one ends now (its end recorded here), a running one is asked to
    stop (its finish records it). True when a running turn was asked."""
    with transaction.atomic():
        waiting = _waiting_turns(conversation_id, request_id=request_id)
        running = fiber_request_cancel(conversation_id=conversation_id, request_id=request_id)
        for cancelled, snapshot in waiting.items():
            completion_record(
                conversation_id=conversation_id,
                request_id=root_of(cancelled, snapshot),
                last_request_id=cancelled,
                ending=Ending.CANCELLED,
            )
    return running


def turn_enqueue(*, fiber_id: Any, conversation_id: int) -> None:
    """Hand a fiber to a worker, unless another turn of the conversation runs (it will start this one)."""
    if next_pending_fiber(conversation_id=conversation_id) == fiber_id:
        turn_send(fiber_id)


def turn_enqueue_pending(conversation_id: int) -> None:
    """How the recovery layer sends a conversation's head pending turn again (chat.turn.interrupted)."""
    turn_enqueue_next(conversation_id=conversation_id)


def turn_enqueue_next(*, conversation_id: int) -> None:
    fiber_id = next_pending_fiber(conversation_id=conversation_id)
    if fiber_id is not None:
        turn_send(fiber_id)


def turn_send(fiber_id: Any) -> None:
    """Send a fiber's turn to the workers (by task name: this layer never imports the worker's code)."""
    current_app.send_task(RUN_TURN, args=[str(fiber_id)])


@dataclass(frozen=True)
class TurnResult:
    """A programmatic turn: its request id and status (`accepted` until waited for, then its outcome)."""

    request_id: str
    status: str  # accepted, completed, error, aborted or skipped


def ui_messages(value: Any) -> list[UIMessage]:
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
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            with transaction.atomic():
                conversation = _lock_when_idle(conversation_id)
                current = messages_list(conversation_id=conversation_id)
                new = ui_messages(messages(current) if callable(messages) else messages)
                files = attachments_resolve(conversation_id, new, check={m["id"] for m in new})
                new = files.messages
                principal_file_refusal(conversation.owner, sum(len(f.data) for f in files.new))
                files_store(conversation_id, conversation.owner, files.new)
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


def wait_until_stable(*, conversation_id: int, timeout: float | None = None) -> bool:
    """Wait until no turn runs and no human is pending; False when `timeout` seconds pass first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not conversation_stable(conversation_id=conversation_id):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


async def await_stable(*, conversation_id: int, timeout: float | None = None) -> bool:
    """wait_until_stable for async callers (the recovery alarms): polls without holding a thread."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not await db(conversation_stable, conversation_id=conversation_id):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True
