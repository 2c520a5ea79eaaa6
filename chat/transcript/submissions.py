"""Durable submissions (`submit_messages`): accepted now, run when the conversation is free.

Acceptance writes the row and a drain alarm in one transaction, so an accepted submission survives any
crash. The drain applies the messages and creates the turn's fiber in one transaction, so "messages
applied" and "turn exists" are never apart. Its status follows the turn and any recovery of it.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.db.models.functions import Now

from recovery.engine.alarms import alarm_claim, alarm_schedule
from recovery.models import ACTIVE_STATUSES, Fiber
from recovery.observe import diagnostics
from recovery.process import dispatch
from recovery.process.runtime import db

from ..exceptions import ConversationBusy, SubmissionConflict, SubmissionNotFound
from ..models import Conversation, Submission
from .selectors import chain_outcome
from .turns import turn_cancel, turn_start_programmatic, ui_messages

logger = logging.getLogger(__name__)

DRAIN_CALLBACK = "think_drain_submissions"
SKIPPED_TEXT = "Submission was skipped by turn reset."
INTERRUPTED_TEXT = "Submission was interrupted after messages were applied."


@dataclass(frozen=True)
class SubmitResult:
    submission_id: str
    request_id: str
    status: str
    accepted: bool  # False when an existing submission with that id or key was returned


def _result(row: Submission, *, accepted: bool) -> SubmitResult:
    return SubmitResult(row.submission_id, row.request_id, row.status, accepted)


def _emit(conversation: Conversation, event: str, payload: dict[str, Any]) -> None:
    diagnostics.emit(event, payload, agent=conversation.agent, name=conversation.name)


def _schedule_drain(conversation_id: int) -> None:
    alarm = alarm_schedule(
        conversation_id=conversation_id, callback=DRAIN_CALLBACK, payload={}, idempotent=True
    )

    def fire() -> None:  # due now: fire at once, the row stays the durable copy
        if alarm_claim(alarm_id=alarm.pk):
            dispatch.fire_later(alarm.pk)

    transaction.on_commit(fire)


def submission_create(
    *,
    conversation_id: int,
    messages: Any,
    submission_id: str | None = None,
    idempotency_key: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> SubmitResult:
    """Accept a submission durably; an existing id or key returns that submission (accepted False)."""
    new_messages = ui_messages(messages)
    for value, label in ((submission_id, "submission_id"), (idempotency_key, "idempotency_key")):
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 255):
            raise ValueError(f"{label} must be a non-empty string of at most 255 characters")
    with transaction.atomic():
        conversation = Conversation.objects.select_for_update().get(pk=conversation_id)
        rows = Submission.objects.filter(conversation=conversation)
        by_id = rows.filter(submission_id=submission_id).first() if submission_id else None
        by_key = rows.filter(idempotency_key=idempotency_key).first() if idempotency_key else None
        if by_id is not None and by_key is not None and by_id.pk != by_key.pk:
            raise SubmissionConflict(
                f"submission_id {submission_id!r} and idempotency_key {idempotency_key!r} "
                "belong to different submissions"
            )
        existing = by_id or by_key
        if existing is not None:
            if existing.status == Submission.Status.PENDING:
                _schedule_drain(conversation_id)
            return _result(existing, accepted=False)
        sid = submission_id or _new_id()
        row = Submission.objects.create(
            conversation=conversation,
            submission_id=sid,
            request_id=sid,
            idempotency_key=idempotency_key,
            messages=new_messages,
            metadata=metadata,
        )
        _schedule_drain(conversation_id)
    _emit(
        conversation,
        "submission:create",
        {"submissionId": sid, "requestId": sid, "idempotencyKey": idempotency_key},
    )
    _emit(conversation, "submission:status", {"submissionId": sid, "status": row.status})
    return _result(row, accepted=True)


def _new_id() -> str:
    return str(uuid.uuid4())


def submissions_drain(*, conversation_id: int) -> str | None:
    """Start the oldest pending submission if the conversation is free; its request id, or None."""

    row = (
        Submission.objects.filter(conversation_id=conversation_id, status=Submission.Status.PENDING)
        .order_by("created_at", "submission_id")
        .first()
    )
    if row is None:
        return None

    def claimed(conversation: Conversation) -> None:
        updated = Submission.objects.filter(pk=row.pk, status=Submission.Status.PENDING).update(
            status=Submission.Status.RUNNING, started_at=Now(), messages_applied_at=Now()
        )
        if not updated:  # cancelled meanwhile: roll the turn back
            raise _Gone

    try:
        turn_start_programmatic(
            conversation_id=conversation_id,
            messages=row.messages,
            request_id=row.request_id,
            timeout=0,
            submission_id=row.submission_id,
            on_applied=claimed,
        )
    except ConversationBusy:
        return None  # the running turn drains again when it finishes
    except _Gone:
        return submissions_drain(conversation_id=conversation_id)
    except (IntegrityError, ValueError):
        logger.exception("submission %s could not start", row.submission_id)
        submission_set_status(row.pk, Submission.Status.ERROR, "Submission messages could not be applied.")
        return None
    conversation = Conversation.objects.get(pk=conversation_id)
    _emit(conversation, "submission:status", {"submissionId": row.submission_id, "status": "running"})
    return row.request_id


class _Gone(Exception):
    pass


def submission_set_status(
    pk: int, status: str, error: str = "", *, only_from: list[str] | None = None
) -> bool:
    """Move an open submission to `status`; an ended one (a cancel, say) is never overwritten."""
    open_statuses = only_from or [Submission.Status.PENDING, Submission.Status.RUNNING]
    rows = Submission.objects.filter(pk=pk, status__in=open_statuses)
    updated = rows.update(status=status, error=error, finished_at=Now())
    if updated:
        row = Submission.objects.select_related("conversation").get(pk=pk)
        _emit(row.conversation, "submission:status", {"submissionId": row.submission_id, "status": status})
    return bool(updated)


def submission_turn_finished(*, conversation_id: int, root_request_id: str) -> None:
    """A turn of a submission's chain ended: settle the submission once the chain has an outcome."""
    row = Submission.objects.filter(
        conversation_id=conversation_id, request_id=root_request_id, status=Submission.Status.RUNNING
    ).first()
    if row is None:
        return
    outcome = chain_outcome(conversation_id=conversation_id, root_request_id=root_request_id)
    if outcome is None:
        return
    error = ""
    if outcome == "skipped":  # applied, yet no turn of it exists any more
        outcome, error = "error", INTERRUPTED_TEXT
    elif outcome == "error":
        fiber = Fiber.objects.filter(conversation_id=conversation_id, request_id=root_request_id).first()
        terminal = Conversation.objects.values_list("last_terminal", flat=True).get(pk=conversation_id) or {}
        error = str(terminal.get("body") or (fiber.error if fiber else "") or "The turn ended with an error.")
    submission_set_status(row.pk, outcome, error, only_from=[Submission.Status.RUNNING])


async def drain_alarm(conversation: Conversation, data: dict[str, Any]) -> None:
    """The drain alarm's callback (registered in chat.apps): start the next pending submission."""

    await db(submissions_drain, conversation_id=conversation.pk)


def submissions_sweep() -> int:
    """Settle running submissions whose chain has ended, drain free conversations; for the beat tick."""
    settled = 0
    running = Submission.objects.filter(status=Submission.Status.RUNNING)
    for row in running.only("pk", "conversation_id", "request_id", "messages_applied_at"):
        if row.messages_applied_at is None:  # never applied: it can simply run again
            running.filter(pk=row.pk).update(status=Submission.Status.PENDING)
            continue
        outcome = chain_outcome(conversation_id=row.conversation_id, root_request_id=row.request_id)
        if outcome is not None:
            submission_turn_finished(conversation_id=row.conversation_id, root_request_id=row.request_id)
            settled += 1
    pending = (
        Submission.objects.filter(status=Submission.Status.PENDING)
        .exclude(conversation__fibers__status__in=ACTIVE_STATUSES)
        .values_list("conversation_id", flat=True)
        .distinct()
    )
    for conversation_id in list(pending[:100]):
        submissions_drain(conversation_id=conversation_id)
    return settled


def submission_cancel(*, conversation_id: int, submission_id: str) -> bool:
    """Abort a pending or running submission (its turn stops, keeping its partial); False if it had ended."""

    row = Submission.objects.filter(conversation_id=conversation_id, submission_id=submission_id).first()
    if row is None:
        raise SubmissionNotFound(submission_id)
    if not submission_set_status(row.pk, Submission.Status.ABORTED):
        return False
    turn_cancel(conversation_id=conversation_id, request_id=row.request_id)
    return True


def submissions_skip_all(*, conversation_id: int) -> None:
    """A clear resets the conversation: every open submission is skipped."""
    for pk in Submission.objects.filter(conversation_id=conversation_id).open().values_list("pk", flat=True):
        submission_set_status(pk, Submission.Status.SKIPPED, SKIPPED_TEXT)


def submission_get(*, conversation_id: int, submission_id: str) -> Submission:
    row = Submission.objects.filter(conversation_id=conversation_id, submission_id=submission_id).first()
    if row is None:
        raise SubmissionNotFound(submission_id)
    return row


def submission_delete(*, conversation_id: int, submission_id: str) -> bool:
    """Delete a finished submission; open ones are kept (False)."""
    deleted, _ = (
        Submission.objects.filter(conversation_id=conversation_id, submission_id=submission_id)
        .filter(~Q(status__in=[Submission.Status.PENDING, Submission.Status.RUNNING]))
        .delete()
    )
    return bool(deleted)
