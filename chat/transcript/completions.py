"""How turns ended: one row per turn (chat.models.TurnCompletion), written in the transaction that ended
it, like an outbox, so the news of a turn finished by another worker after a crash is never lost.

Every path that ends a turn records it here: a turn's finish (chat.transcript.finish), recovery's give-up
or skip (chat.turn.interrupted, chat.turn.continuation), a cancel of a queued turn, a stop of the
conversation, a clear, a newer request replacing a queued one. A turn is its request and the recoveries
that continued it: the row is keyed by the chain's root, and only the first ending counts.

Delivery (chat.turn.deliveries) claims a row, runs the `turn_completed` receivers and the agent's
`on_turn_completed`, and marks it delivered; a row its process never delivered (it died after the
commit) is delivered by the recovery tick's sweep once its claim is stale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from ..models import Message, TurnCompletion
from ..types import UIMessage
from .snapshot import FiberSnapshot

logger = logging.getLogger(__name__)

Ending = TurnCompletion.Ending

# A row nobody delivered this long after its commit is the sweep's (its process died, or never had a
# loop to deliver it on); a claim older than CLAIM_TTL is taken again (its deliverer died mid-way).
SWEEP_AFTER = timedelta(seconds=5)
CLAIM_TTL = timedelta(seconds=60)
# Delivered rows are kept this long (a receiver that deduplicates by request id can look back), then pruned.
RETENTION = timedelta(days=7)

# Called after the commit with the ids of the rows it wrote (chat.turn.deliveries registers the
# delivery: the transcript layer does not import the turn layer).
_listeners: list[Callable[[list[int]], None]] = []
# Whether anyone hears of an agent's turns (a turn_completed receiver, or the agent's own hook); None
# until registered. A turn nobody hears of is recorded as delivered: no work after its commit.
_heard: Callable[[str], bool] | None = None


def on_recorded(listener: Callable[[list[int]], None], heard: Callable[[str], bool] | None = None) -> None:
    global _heard
    if listener not in _listeners:
        _listeners.append(listener)
    if heard is not None:
        _heard = heard


_RECORD = """
INSERT INTO {table}
    (conversation_id, request_id, last_request_id, ending, message_id, error, created_at, attempts,
     delivered_at)
VALUES (%s, %s, %s, %s, %s, %s, now(), 0, CASE WHEN %s THEN now() END)
ON CONFLICT (conversation_id, request_id) DO NOTHING
RETURNING id
"""


def completion_record(
    *,
    conversation_id: int,
    request_id: str,
    ending: str,
    last_request_id: str = "",
    message_id: str | None = None,
    error: str = "",
    agent: str | None = None,
) -> bool:
    """Record how the turn `request_id` (a chain's root) ended; call inside the transaction that ended
    it. The first ending of a turn stands (False for a later one). Delivered after the commit, unless
    nobody hears of `agent`'s turns (then it is recorded delivered: the turn's end costs one INSERT)."""
    if not request_id:
        return False
    unheard = agent is not None and _heard is not None and not _heard(agent)
    with connection.cursor() as cursor:
        cursor.execute(
            _RECORD.format(table=TurnCompletion._meta.db_table),
            [
                conversation_id,
                request_id,
                last_request_id or request_id,
                ending,
                message_id or "",
                error,
                unheard,
            ],
        )
        row = cursor.fetchone()
    if row is None:
        return False
    if not unheard:
        pk = row[0]
        transaction.on_commit(lambda: _recorded([pk]))
    return True


def root_of(request_id: str, snapshot: Any) -> str:
    """The turn a fiber belongs to: its chain's root, from the fiber's snapshot (itself when none)."""
    turn = FiberSnapshot.from_json(snapshot).turn
    root = turn.root_request_id if turn is not None else None
    return root if isinstance(root, str) and root else request_id


def completions_record(
    *, conversation_id: int, endings: Iterable[tuple[str, str]], ending: str, message_id: str | None = None
) -> None:
    """Record one ending for several turns: (root, last request id) pairs, in the caller's transaction."""
    for root, last in dict(endings).items():
        completion_record(
            conversation_id=conversation_id,
            request_id=root,
            last_request_id=last,
            ending=ending,
            message_id=message_id,
        )


def _recorded(ids: list[int]) -> None:
    for listener in list(_listeners):
        try:
            listener(ids)
        except Exception:  # the sweep delivers what a listener could not
            logger.exception("turn completion listener failed")


def completion_claim(*, pk: int) -> TurnCompletion | None:
    """Take an undelivered row for delivery (nobody else holds it, or their claim is stale)."""
    claimed = TurnCompletion.objects.filter(
        Q(claimed_at__isnull=True) | Q(claimed_at__lt=Now() - CLAIM_TTL), pk=pk, delivered_at__isnull=True
    ).update(claimed_at=Now(), attempts=F("attempts") + 1)
    if not claimed:
        return None
    return TurnCompletion.objects.select_related("conversation").get(pk=pk)


def completion_delivered(*, pk: int) -> None:
    TurnCompletion.objects.filter(pk=pk).update(delivered_at=Now())


def completions_due(*, limit: int = 100) -> list[int]:
    """Rows left undelivered past SWEEP_AFTER, whose claim (if any) is stale: the sweep's."""
    due = TurnCompletion.objects.filter(delivered_at__isnull=True, created_at__lt=Now() - SWEEP_AFTER).filter(
        Q(claimed_at__isnull=True) | Q(claimed_at__lt=Now() - CLAIM_TTL)
    )
    return list(due.order_by("created_at").values_list("pk", flat=True)[:limit])


def completion_message(completion: TurnCompletion) -> UIMessage | None:
    """The turn's answer as stored now (None when it stored none, or it is gone)."""
    if not completion.message_id:
        return None
    row = Message.objects.filter(
        conversation_id=completion.conversation_id, message_id=completion.message_id
    ).first()
    return None if row is None else row.as_ui_message()


def completions_prune() -> int:
    """Delete rows delivered more than RETENTION ago; how many."""
    deleted, _ = TurnCompletion.objects.filter(delivered_at__lt=Now() - RETENTION).delete()
    return deleted
