"""Branches: a regenerated answer, or an edited user message, keeps what it replaces.

The branch in use is the Message table, linear as ever: turns, recovery, compaction, windows and the
model read it and nothing else. A regenerate sets the answer it replaces aside (everything after the
user message it answers), an edit of a user message sets aside that message and what followed it: a
`Branch` row holds those messages, with the compactions of their range, under the message they
followed (the anchor). Switching brings one back and sets the one in use aside, in one transaction,
only while nothing runs or recovers in the conversation, so a turn (or its recovery after a kill)
always ends on the branch it started on.

The alternatives after an anchor are numbered by when their first message was created; clients see,
on the first message after an anchor with alternatives, `metadata.thinkBranch = {"anchorId", "index",
"count"}` (`annotate`), and switch with `cf_agent_chat_branch` (docs/protocol.md, "Branches").
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils.dateparse import parse_datetime

from recovery.budget.incidents import LIVE_STATUSES
from recovery.lease.fibers import conversation_busy
from recovery.models import Fiber, Incident

from ..exceptions import BranchNotFound, ConversationBusy
from ..models import Branch, Compaction, Conversation, Message
from ..types import UIMessage
from .services import conversation_lock

BRANCH_KEY = "thinkBranch"  # the metadata key of the annotation clients see


def _compaction_json(row: Compaction) -> dict[str, Any]:
    return {
        "compaction_id": row.compaction_id,
        "from_message_id": row.from_message_id,
        "to_message_id": row.to_message_id,
        "summary": row.summary,
        "created_at": row.created_at.isoformat(),
    }


@dataclass(frozen=True)
class Anchor:
    """The message a tail follows, in the version on the branch in use ("" and None: the start)."""

    message_id: str
    created_at: datetime | None
    position: int

    def branches(self, conversation_id: int) -> Any:
        """The alternatives set aside under this version of the anchor (a row from before versions
        were recorded matches any)."""
        rows = Branch.objects.filter(conversation_id=conversation_id, anchor_message_id=self.message_id)
        if self.created_at is None:
            return rows
        return rows.filter(Q(anchor_created_at=self.created_at) | Q(anchor_created_at__isnull=True))


START = Anchor("", None, -1)


def _anchor(conversation_id: int, anchor_message_id: str) -> Anchor:
    """The anchor in use; BranchNotFound when it is not on the branch in use."""
    if not anchor_message_id:
        return START
    row = (
        Message.objects.filter(conversation_id=conversation_id, message_id=anchor_message_id)
        .values_list("position", "created_at")
        .first()
    )
    if row is None:
        raise BranchNotFound(f"message {anchor_message_id!r} is not on the branch in use")
    return Anchor(anchor_message_id, row[1], row[0])


def tail_set_aside(*, conversation_id: int, after_position: int) -> Branch | None:
    """Set aside every message after `after_position` (with the compactions that reach into them) as a
    branch under the message at that position; None when nothing follows it. Call with the
    conversation locked."""
    tail = list(
        Message.objects.filter(conversation_id=conversation_id, position__gt=after_position).order_by(
            "position"
        )
    )
    if not tail:
        return None
    row = (
        Message.objects.filter(conversation_id=conversation_id, position=after_position)
        .values_list("message_id", "created_at")
        .first()
        if after_position >= 0
        else None
    )
    anchor = START if row is None else Anchor(row[0], row[1], after_position)
    ids = [m.message_id for m in tail]
    touched = Compaction.objects.filter(conversation_id=conversation_id).filter(
        Q(from_message_id__in=ids) | Q(to_message_id__in=ids)
    )
    branch = Branch.objects.create(
        conversation_id=conversation_id,
        anchor_message_id=anchor.message_id,
        anchor_created_at=anchor.created_at,
        messages=[{**m.as_ui_message(), "createdAt": m.created_at.isoformat()} for m in tail],
        compactions=[_compaction_json(c) for c in touched],
        first_created_at=tail[0].created_at,
    )
    touched.delete()
    Message.objects.filter(pk__in=[m.pk for m in tail]).delete()
    return branch


def _restore(conversation_id: int, branch: Branch, after_position: int) -> None:
    for offset, message in enumerate(branch.messages):
        created = parse_datetime(str(message.get("createdAt")))
        row = Message.objects.create(
            conversation_id=conversation_id,
            message_id=message["id"],
            role=message["role"],
            parts=message.get("parts", []),
            metadata=message.get("metadata"),
            position=after_position + 1 + offset,
        )
        if created is not None:  # its own time: the alternatives are numbered by it
            Message.objects.filter(pk=row.pk).update(created_at=created)
    for compaction in branch.compactions:
        summary = Compaction.objects.create(
            conversation_id=conversation_id,
            compaction_id=compaction["compaction_id"],
            from_message_id=compaction["from_message_id"],
            to_message_id=compaction["to_message_id"],
            summary=compaction["summary"],
        )
        created = parse_datetime(str(compaction.get("created_at")))
        if created is not None:
            Compaction.objects.filter(pk=summary.pk).update(created_at=created)
    branch.delete()


@dataclass(frozen=True)
class Alternatives:
    """The alternatives after one anchor: when each began, the one in use marked."""

    anchor_message_id: str
    starts: list[tuple[datetime, int | None]]  # (first message's creation, Branch pk or None: in use)

    @property
    def count(self) -> int:
        return len(self.starts)

    def index_in_use(self) -> int:
        return next(i for i, (_, pk) in enumerate(self.starts) if pk is None)


def _alternatives(conversation_id: int, anchor: Anchor) -> Alternatives:
    rows = anchor.branches(conversation_id)
    starts: list[tuple[datetime, int | None]] = [(b.first_created_at, b.pk) for b in rows]
    first = (
        Message.objects.filter(conversation_id=conversation_id, position=anchor.position + 1)
        .values_list("created_at", flat=True)
        .first()
    )
    if first is not None:
        starts.append((first, None))
    starts.sort(key=lambda start: (start[0], start[1] is None))
    return Alternatives(anchor.message_id, starts)


def _refuse_while_running(conversation_id: int) -> None:
    """A branch changes only while nothing runs or recovers: a turn ends on the branch it began on."""
    if conversation_busy(conversation_id):
        raise ConversationBusy(
            "a turn is queued or running in this conversation; switch branches when it ends"
        )
    interrupted = Fiber.objects.filter(conversation_id=conversation_id, status=Fiber.Status.INTERRUPTED)
    if (
        interrupted.exists()
        or Incident.objects.filter(conversation_id=conversation_id, status__in=LIVE_STATUSES).exists()
    ):
        raise ConversationBusy("a turn of this conversation is being recovered; switch branches when it ends")


def branch_switch(*, conversation_id: int, anchor_message_id: str, index: int) -> bool:
    """Bring back alternative `index` (0-based, by when it began) after `anchor_message_id` ("" for
    the start), setting the one in use aside; False when it is already in use. Raises BranchNotFound
    for an unknown anchor or index, ConversationBusy while a turn runs or recovers."""
    with transaction.atomic():
        conversation_lock(conversation_id)
        _refuse_while_running(conversation_id)
        anchor = _anchor(conversation_id, anchor_message_id)
        alternatives = _alternatives(conversation_id, anchor)
        if not 0 <= index < alternatives.count:
            raise BranchNotFound(
                f"there are {alternatives.count} alternative(s) after {anchor_message_id or 'the start'}, "
                f"not {index + 1}"
            )
        chosen = alternatives.starts[index][1]
        if chosen is None:
            return False
        branch = Branch.objects.get(pk=chosen)
        tail_set_aside(conversation_id=conversation_id, after_position=anchor.position)
        _restore(conversation_id, branch, anchor.position)
    return True


def annotate(
    conversation_id: int, messages: list[UIMessage], *, starts_at_beginning: bool
) -> list[UIMessage]:
    """Mark, in a window of the branch in use (oldest first), the first message after each anchor that
    has alternatives: `metadata.thinkBranch = {"anchorId", "index", "count"}`. One query when the
    conversation has no branches."""
    anchors = set(
        Branch.objects.filter(conversation_id=conversation_id).values_list("anchor_message_id", flat=True)
    )
    if not anchors:
        return messages
    for i, message in enumerate(messages):
        previous = messages[i - 1]["id"] if i > 0 else ("" if starts_at_beginning else None)
        if previous is None or previous not in anchors:
            continue
        alternatives = _alternatives(conversation_id, _anchor(conversation_id, previous))
        if alternatives.count < 2:  # those set aside follow another version of the anchor
            continue
        note = {"anchorId": previous, "index": alternatives.index_in_use(), "count": alternatives.count}
        messages[i] = {**message, "metadata": {**(message.get("metadata") or {}), BRANCH_KEY: note}}
    return messages


def branch_list(*, conversation_id: int) -> list[dict[str, Any]]:
    """Every alternative set aside, for the admin and tests: anchor, begun at, its messages."""
    return [
        {"anchorId": b.anchor_message_id, "begun": b.first_created_at, "messages": b.messages}
        for b in Branch.objects.filter(conversation_id=conversation_id)
    ]


def conversation_has_branches(conversation: Conversation) -> bool:
    return Branch.objects.filter(conversation=conversation).exists()
