"""Database-level tests of the recovery persistence and the recovery engine.

Covers the incident store, durable alarms, detection (the beat tick), the fenced stream writes, the
recovery state the engine reads, and `arecover_fiber` end to end against Postgres. Each test builds
its rows through the real services (`fiber_claim`, `stream_open`, `segment_append`, `tick_claim`),
so what is set up is what a crashed worker would really leave behind.

Sync tests run inside one transaction, where Postgres' `now()` is the transaction's start time; leases
are therefore expired by moving them minutes into the past. Tests that need a second connection (SKIP
LOCKED) or the engine's DB threads use `transaction=True`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import pytest
from django.db import connection, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from chat.agents import ChatRecovery, ChatRecoveryContext, ChatRecoveryOptions, Think
from chat.models import Conversation, Message
from chat.transcript.selectors import messages_list
from chat.transcript.services import message_upsert
from chat.transcript.snapshot import TurnKind
from chat.transcript.turns import turn_snapshot
from chat.turn.interrupted import (
    CONTINUE_CALLBACK,
    DECLINED_MESSAGE,
    RETRY_CALLBACK,
    conversation_set_recovering,
    load_target,
    orphan_persist,
)
from chat.turn.runner import CLAIM_FIELDS
from recovery.budget.incidents import (
    DEFAULT_TERMINAL_MESSAGE,
    INCIDENT_DEBOUNCE_MS,
    INCIDENT_TTL_MS,
    ExhaustedContext,
    Incident,
)
from recovery.engine.alarms import (
    ALARM_CLAIM_TTL,
    alarm_done,
    alarm_retry_later,
    alarm_schedule,
    alarms_claim_due,
)
from recovery.engine.detection import tick_claim
from recovery.engine.spine import arecover_fiber
from recovery.engine.store import (
    incident_begin,
    incident_get,
    incident_mark_running,
    incident_save,
    incident_set_status,
    incidents_expire,
)
from recovery.exceptions import LeaseLost
from recovery.lease.fibers import (
    HANDLING_TTL,
    RECOVERY_OWNER,
    STASH_SLOT,
    Claim,
    fiber_claim,
    fiber_finish,
    fiber_interrupt,
    fiber_release,
    fiber_request_cancel,
    lease_ttl,
)
from recovery.models import Alarm, Fiber, Segment, Stream
from recovery.models import Incident as IncidentRow
from recovery.process import dispatch
from recovery.process.runtime import db
from recovery.stream.buffer import segment_append, stream_chunks, stream_open
from recovery.stream.encoding import dumps as encode_chunk
from tests.operator_support import terminate_new_backends
from tests.support import row_locked_elsewhere

T0 = 1_700_000_000_000  # an injected clock, far from the real one
T = TypeVar("T")


# --------------------------------------------------------------------------------------------------------
# Factories (sync: call them directly in sync tests, through `db(...)` in async ones)
# --------------------------------------------------------------------------------------------------------


def make_conversation(*, agent: str = "assistant", **fields: Any) -> Conversation:
    return Conversation.objects.create(agent=agent, name=f"c-{uuid.uuid4().hex[:10]}", **fields)


def add_message(conversation: Conversation, *, role: str = "user", text: str = "hello") -> str:
    message_id = f"{role[0]}-{uuid.uuid4().hex[:8]}"
    message = {"id": message_id, "role": role, "parts": [{"type": "text", "text": text}]}
    message_upsert(conversation_id=conversation.pk, message=message)
    return message_id


def make_fiber(
    conversation: Conversation,
    *,
    request_id: str | None = None,
    continuation: bool = False,
    stash: Any = None,
) -> Fiber:
    """A pending fiber with the snapshot a real turn writes before calling the model."""
    request_id = request_id or f"req-{uuid.uuid4().hex[:8]}"
    conversation.refresh_from_db()
    snapshot = turn_snapshot(conversation=conversation, request_id=request_id, continuation=continuation)
    stored = {**snapshot.envelope(), STASH_SLOT: stash}
    return Fiber.objects.create(
        conversation=conversation, request_id=request_id, kind=TurnKind.CHAT, snapshot=stored
    )


def claim(fiber: Fiber, *, owner: str = "worker-1") -> Claim:
    claimed = fiber_claim(fiber_id=fiber.pk, owner=owner, fields=CLAIM_FIELDS)
    assert claimed is not None
    return claimed


def expire_lease(fiber_id: Any) -> None:
    """Move the lease minutes into the past (also past the transaction start time of sync tests)."""
    Fiber.objects.filter(pk=fiber_id).update(lease_expires_at=timezone.now() - timedelta(minutes=5))


def fiber_row(fiber_id: Any) -> Fiber:
    return Fiber.objects.get(pk=fiber_id)


def chunk_bodies(*chunks: dict[str, Any]) -> list[str]:
    return [encode_chunk(chunk) for chunk in chunks]


def append(
    claimed: Claim,
    stream_id: Any,
    bodies: list[str],
    *,
    seq_start: int = 0,
    credit: int = 0,
    reattach: str | None = None,
) -> Any:
    return segment_append(
        fiber_id=claimed.fiber_id,
        fencing=claimed.fencing,
        stream_id=stream_id,
        seq_start=seq_start,
        seq_end=seq_start + len(bodies) - 1,
        body="\n".join(bodies),
        credit=credit,
        reattach=reattach,
    )


def open_stream(claimed: Claim, *, message_id: str = "a-stream") -> Any:
    return stream_open(
        conversation_id=claimed.conversation_id,
        fiber_id=claimed.fiber_id,
        fencing=claimed.fencing,
        request_id=claimed.request_id,
        message_id=message_id,
        continuation=False,
    )


START = {"type": "start", "messageId": "provider-message-id"}
START_STEP = {"type": "start-step"}
PARTIAL_TEXT = [
    START,
    START_STEP,
    {"type": "text-start", "id": "t1"},
    {"type": "text-delta", "id": "t1", "delta": "Partial "},
    {"type": "text-delta", "id": "t1", "delta": "answer"},
]
SETTLED_TOOL = [
    START,
    START_STEP,
    {
        "type": "tool-input-available",
        "toolCallId": "call-1",
        "toolName": "weather",
        "input": {"city": "Oslo"},
    },
    {"type": "tool-output-available", "toolCallId": "call-1", "output": {"temp": 3}},
]


@dataclass(frozen=True)
class Turn:
    """An interrupted turn as a crashed worker leaves it: what the engine will be handed."""

    conversation_id: int
    fiber_id: Any
    request_id: str
    user_id: str
    stream_id: Any = None

    @property
    def incident_id(self) -> str:
        return f"{self.request_id}:{self.user_id}"


def interrupted_turn(
    *,
    agent: str = "assistant",
    chunks: list[dict[str, Any]] | None = None,
    stream_status: str = Stream.Status.STREAMING,
    continuation: bool = False,
    answered: bool = False,
    stash: Any = None,
    last_body: dict[str, Any] | None = None,
) -> Turn:
    """A user message, a turn claimed by a worker (optionally with a stream of chunks), then the lease
    expires and the beat tick takes the fiber (status interrupted). `chunks=None` means no stream."""
    conversation = make_conversation(agent=agent, last_body=last_body)
    user_id = add_message(conversation, text="What is the weather in Oslo?")
    if answered:
        add_message(conversation, role="assistant", text="Cold.")
    fiber = make_fiber(conversation, continuation=continuation, stash=stash)
    claimed = claim(fiber)
    stream_id = None
    if chunks is not None:
        stream_id = open_stream(claimed)
        if chunks:
            assert append(claimed, stream_id, chunk_bodies(*chunks)) is not None
        if stream_status != Stream.Status.STREAMING:
            Stream.objects.filter(pk=stream_id).update(status=stream_status, completed_at=timezone.now())
    expire_lease(fiber.pk)
    assert fiber.pk in tick_claim().fibers
    return Turn(conversation.pk, fiber.pk, fiber.request_id, user_id, stream_id)


def incident_record(**changes: Any) -> Incident:
    base = Incident(
        incident_id="req-1:u-1",
        request_id="req-1",
        recovery_root_request_id="req-1",
        recovery_kind="continue",
        attempt=1,
        max_attempts=10,
        status="scheduled",
        first_seen_at=T0,
        last_attempt_at=T0,
        last_progress_at=T0,
        progress=0,
        work_baseline=0,
    )
    return dataclasses.replace(base, **changes)


def begin(conversation: Conversation, *, now_ms: int = T0, **overrides: Any) -> Any:
    arguments: dict[str, Any] = {
        "conversation_id": conversation.pk,
        "incident_id": "req-1:u-1",
        "request_id": "req-1",
        "recovery_root_request_id": "req-1",
        "recovery_kind": "continue",
        "config": ChatRecovery(),
        "now_ms": now_ms,
        "awaiting": False,
    }
    return incident_begin(**{**arguments, **overrides})


def schedule(conversation: Conversation, payload: dict[str, Any], **kwargs: Any) -> Alarm:
    kwargs.setdefault("idempotent", True)
    return alarm_schedule(
        conversation_id=conversation.pk, callback=CONTINUE_CALLBACK, payload=payload, **kwargs
    )


def claim_without_waiting(claim_fn: Callable[[], T]) -> T:
    """Run a claim with a short lock timeout: a claim that waited on a lock fails instead of hanging."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '3s'")
        return claim_fn()


# --------------------------------------------------------------------------------------------------------
# 1. Incident store
# --------------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_incident_begin_opens_and_persists_under_conversation_and_incident_id() -> None:
    first, second = make_conversation(progress=7), make_conversation()

    evaluation = begin(first)
    begin(second)

    assert evaluation.opened and not evaluation.exhausted
    row = IncidentRow.objects.get(conversation=first, incident_id="req-1:u-1")
    assert (row.attempt, row.status, row.recovery_kind) == (1, "attempting", "continue")
    assert (row.progress, row.work_baseline) == (7, 7)
    assert incident_get(conversation_id=first.pk, incident_id="req-1:u-1") == evaluation.incident
    # The same incident id in another conversation is another record.
    assert IncidentRow.objects.filter(incident_id="req-1:u-1").count() == 2


@pytest.mark.django_db
def test_incident_begin_uses_the_injected_clock() -> None:
    conversation = make_conversation()

    evaluation = begin(conversation, now_ms=T0 + 123)

    row = IncidentRow.objects.get(conversation=conversation)
    assert row.first_seen_at == row.last_attempt_at == row.last_progress_at == T0 + 123
    assert evaluation.incident.last_attempt_at == T0 + 123


@pytest.mark.django_db
def test_incident_begin_re_evaluates_an_existing_record_without_reopening_it() -> None:
    conversation = make_conversation()
    begin(conversation, now_ms=T0)

    again = begin(conversation, now_ms=T0 + 5_000, recovery_kind="retry")

    assert not again.opened
    row = IncidentRow.objects.get(conversation=conversation)
    assert (row.first_seen_at, row.last_attempt_at) == (T0, T0 + 5_000)
    assert row.attempt == 1  # inside the 30 s debounce: no attempt spent
    assert row.recovery_kind == "retry"  # the kind is re-read, the budget is shared


@pytest.mark.django_db
def test_incident_begin_spends_an_attempt_outside_the_debounce_window() -> None:
    conversation = make_conversation()
    begin(conversation, now_ms=T0)

    again = begin(conversation, now_ms=T0 + INCIDENT_DEBOUNCE_MS + 1)

    assert again.incident.attempt == 2
    assert IncidentRow.objects.get(conversation=conversation).attempt == 2


@pytest.mark.django_db
def test_incident_begin_opens_a_fresh_budget_over_a_stale_record_and_closes_other_stale_live_ones() -> None:
    conversation, other = make_conversation(), make_conversation()
    stale_at = T0 - INCIDENT_TTL_MS - 1
    stale = incident_record(attempt=3, first_seen_at=stale_at, last_attempt_at=stale_at)
    incident_save(conversation_id=conversation.pk, incident=stale)
    incident_save(conversation_id=conversation.pk, incident=dataclasses.replace(stale, incident_id="old:"))
    incident_save(conversation_id=other.pk, incident=stale)

    evaluation = begin(conversation, now_ms=T0)

    assert evaluation.opened
    assert (evaluation.incident.attempt, evaluation.incident.first_seen_at) == (1, T0)
    # The records stay (audit trail): the stale budget is replaced, the other stale live one is closed.
    assert sorted(
        IncidentRow.objects.filter(conversation=conversation).values_list(
            "incident_id", "attempt", "status", "reason"
        )
    ) == [("old:", 3, "skipped", "expired"), ("req-1:u-1", 1, "attempting", "")]
    # Per conversation: another conversation's stale record waits for its own evaluation.
    assert IncidentRow.objects.get(conversation=other).status == "scheduled"


@pytest.mark.django_db
def test_incidents_expire_closes_only_live_records_inactive_for_more_than_an_hour() -> None:
    conversation = make_conversation()
    for incident_id, last, status in (
        ("stale", T0 - INCIDENT_TTL_MS - 1, "scheduled"),
        ("stale-running", T0 - INCIDENT_TTL_MS - 1, "running"),
        ("stale-closed", T0 - INCIDENT_TTL_MS - 1, "exhausted"),
        ("edge", T0 - INCIDENT_TTL_MS, "scheduled"),
        ("fresh", T0, "attempting"),
    ):
        incident_save(
            conversation_id=conversation.pk,
            incident=incident_record(
                incident_id=incident_id, first_seen_at=last, last_attempt_at=last, status=status
            ),
        )

    assert incidents_expire(conversation_id=conversation.pk, now_ms=T0) == 2
    assert dict(IncidentRow.objects.values_list("incident_id", "status")) == {
        "stale": "skipped",
        "stale-running": "skipped",
        "stale-closed": "exhausted",
        "edge": "scheduled",
        "fresh": "attempting",
    }


@pytest.mark.django_db
def test_incident_begin_after_a_completed_incident_of_the_same_id_opens_a_fresh_budget() -> None:
    conversation = make_conversation()
    incident_save(conversation_id=conversation.pk, incident=incident_record(attempt=4, status="completed"))

    evaluation = begin(conversation, now_ms=T0 + INCIDENT_DEBOUNCE_MS + 1)

    assert evaluation.opened and evaluation.incident.attempt == 1
    assert IncidentRow.objects.get(conversation=conversation).status == "attempting"


@pytest.mark.django_db
def test_incident_begin_progress_since_the_last_evaluation_resets_the_attempt_to_one() -> None:
    conversation = make_conversation(progress=9)
    previous = incident_record(attempt=4, progress=5, last_attempt_at=T0 - 60_000)
    incident_save(conversation_id=conversation.pk, incident=previous)

    evaluation = begin(conversation, now_ms=T0)

    row = IncidentRow.objects.get(conversation=conversation)
    assert (evaluation.incident.attempt, row.attempt) == (1, 1)
    assert (row.progress, row.last_progress_at, row.work_baseline) == (9, T0, 0)


@pytest.mark.django_db
def test_incident_begin_without_progress_counts_the_next_attempt() -> None:
    conversation = make_conversation(progress=5)
    previous = incident_record(
        attempt=4, progress=5, last_attempt_at=T0 - 60_000, last_progress_at=T0 - 60_000
    )
    incident_save(conversation_id=conversation.pk, incident=previous)

    evaluation = begin(conversation, now_ms=T0)

    assert evaluation.incident.attempt == 5
    assert IncidentRow.objects.get(conversation=conversation).last_progress_at == T0 - 60_000


@pytest.mark.django_db
def test_incident_begin_persists_an_exhausted_record_past_max_attempts() -> None:
    conversation = make_conversation()
    incident_save(
        conversation_id=conversation.pk, incident=incident_record(attempt=2, last_attempt_at=T0 - 60_000)
    )

    evaluation = begin(conversation, now_ms=T0, config=ChatRecovery(max_attempts=2))

    assert evaluation.exhausted and evaluation.reason == "max_attempts_exceeded"
    row = IncidentRow.objects.get(conversation=conversation)
    assert (row.status, row.reason, row.attempt) == ("exhausted", "max_attempts_exceeded", 3)


@pytest.mark.django_db
def test_incident_set_status_completed_keeps_the_record_as_audit_and_returns_it_completed() -> None:
    conversation = make_conversation()
    incident_save(conversation_id=conversation.pk, incident=incident_record(attempt=2))

    record = incident_set_status(conversation_id=conversation.pk, incident_id="req-1:u-1", status="completed")

    assert record == incident_record(attempt=2, status="completed")
    row = IncidentRow.objects.get(conversation=conversation)
    assert (row.status, row.attempt) == ("completed", 2)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("status", "running"),
    [
        ("detected", True),
        ("scheduled", True),
        ("attempting", True),
        ("completed", False),
        ("exhausted", False),
    ],
)
def test_incident_mark_running_moves_only_a_live_incident(status: str, running: bool) -> None:
    conversation = make_conversation()
    incident_save(conversation_id=conversation.pk, incident=incident_record(status=status))

    assert incident_mark_running(conversation_id=conversation.pk, incident_id="req-1:u-1") is running

    assert IncidentRow.objects.get(conversation=conversation).status == ("running" if running else status)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("status", "reason"), [("failed", "hook exploded"), ("skipped", "conversation_changed")]
)
def test_incident_set_status_failed_and_skipped_persist_status_and_reason(status: str, reason: str) -> None:
    conversation = make_conversation()
    incident_save(conversation_id=conversation.pk, incident=incident_record())

    record = incident_set_status(
        conversation_id=conversation.pk, incident_id="req-1:u-1", status=status, reason=reason
    )

    assert record is not None and (record.status, record.reason) == (status, reason)
    row = IncidentRow.objects.get(conversation=conversation)
    assert (row.status, row.reason) == (status, reason)


@pytest.mark.django_db
def test_incident_set_status_without_a_reason_keeps_the_stored_reason() -> None:
    conversation = make_conversation()
    incident_save(conversation_id=conversation.pk, incident=incident_record(reason="stable_timeout_retry"))

    record = incident_set_status(conversation_id=conversation.pk, incident_id="req-1:u-1", status="scheduled")

    assert record is not None and (record.status, record.reason) == ("scheduled", "stable_timeout_retry")


@pytest.mark.django_db
def test_incident_set_status_for_a_missing_id_is_a_no_op_returning_none() -> None:
    conversation = make_conversation()
    incident_save(conversation_id=conversation.pk, incident=incident_record())

    for status in ("completed", "failed", "scheduled"):
        assert (
            incident_set_status(conversation_id=conversation.pk, incident_id="nope:", status=status) is None
        )

    assert list(IncidentRow.objects.values_list("incident_id", "status")) == [("req-1:u-1", "scheduled")]


# --------------------------------------------------------------------------------------------------------
# 2. Durable alarms
# --------------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_idempotent_schedule_of_the_same_callback_and_payload_returns_the_same_row() -> None:
    conversation = make_conversation()

    first = schedule(conversation, {"incidentId": "i-1", "originalRequestId": "r-1"})
    again = schedule(conversation, {"originalRequestId": "r-1", "incidentId": "i-1"})  # key order differs

    assert again.pk == first.pk
    assert Alarm.objects.count() == 1


@pytest.mark.django_db
def test_idempotent_schedule_with_another_payload_callback_or_conversation_adds_a_row() -> None:
    conversation, other = make_conversation(), make_conversation()
    first = schedule(conversation, {"incidentId": "i-1"})

    rows = {
        schedule(conversation, {"incidentId": "i-2"}).pk,
        alarm_schedule(
            conversation_id=conversation.pk,
            callback=RETRY_CALLBACK,
            payload={"incidentId": "i-1"},
            idempotent=True,
        ).pk,
        schedule(other, {"incidentId": "i-1"}).pk,
    }

    assert first.pk not in rows and len(rows) == 3
    assert Alarm.objects.count() == 4


@pytest.mark.django_db
def test_non_idempotent_schedule_always_adds_a_row_even_with_an_identical_payload() -> None:
    conversation = make_conversation()
    payload = {"incidentId": "i-1"}

    pending = schedule(conversation, payload)
    extra = [schedule(conversation, payload, idempotent=False, delay_s=3) for _ in range(2)]

    assert len({pending.pk, *(alarm.pk for alarm in extra)}) == 3
    assert all(alarm.idempotency_key is None for alarm in extra)


@pytest.mark.django_db
def test_a_reschedule_from_a_running_alarm_must_be_non_idempotent_to_survive_its_deletion() -> None:
    """An idempotent schedule joins the running row and is deleted with it; a non-idempotent one survives."""
    conversation = make_conversation()
    payload = {"incidentId": "i-1", "originalRequestId": "r-1"}
    running = schedule(conversation, payload)
    assert alarms_claim_due(limit=10) == [running.pk]

    joined = schedule(conversation, payload)
    rescheduled = schedule(conversation, payload, idempotent=False, delay_s=3)
    alarm_done(alarm_id=running.pk)

    assert joined.pk == running.pk
    assert list(Alarm.objects.values_list("pk", "status")) == [(rescheduled.pk, "pending")]


@pytest.mark.django_db
def test_alarms_claim_due_claims_only_due_pending_alarms_marks_them_running_and_bumps_attempts() -> None:
    conversation = make_conversation()
    due = schedule(conversation, {"n": 1}, delay_s=-5)
    later = schedule(conversation, {"n": 2}, delay_s=60)

    claimed = alarms_claim_due(limit=10)

    assert claimed == [due.pk]
    due.refresh_from_db()
    later.refresh_from_db()
    assert (due.status, due.attempts) == ("running", 1) and due.claimed_at is not None
    assert (later.status, later.attempts, later.claimed_at) == ("pending", 0, None)
    # A freshly claimed alarm is not handed out a second time.
    assert alarms_claim_due(limit=10) == []


@pytest.mark.django_db
def test_alarms_claim_due_takes_the_earliest_due_first_up_to_the_limit() -> None:
    conversation = make_conversation()
    middle = schedule(conversation, {"n": 2}, delay_s=-20)
    newest = schedule(conversation, {"n": 3}, delay_s=-1)
    oldest = schedule(conversation, {"n": 1}, delay_s=-30)

    assert alarms_claim_due(limit=2) == [oldest.pk, middle.pk]
    assert alarms_claim_due(limit=2) == [newest.pk]


@pytest.mark.django_db
def test_alarms_claim_due_re_claims_a_running_alarm_whose_claim_is_older_than_the_ttl() -> None:
    conversation = make_conversation()
    dead_claimer = schedule(conversation, {"n": 1})
    live_claimer = schedule(conversation, {"n": 2})
    assert sorted(alarms_claim_due(limit=10)) == sorted([dead_claimer.pk, live_claimer.pk])
    Alarm.objects.filter(pk=dead_claimer.pk).update(
        claimed_at=timezone.now() - ALARM_CLAIM_TTL - timedelta(seconds=5)
    )

    assert alarms_claim_due(limit=10) == [dead_claimer.pk]
    dead_claimer.refresh_from_db()
    assert (dead_claimer.status, dead_claimer.attempts) == ("running", 2)


@pytest.mark.django_db
def test_alarm_retry_later_puts_a_claimed_alarm_back_as_pending_after_the_delay() -> None:
    conversation = make_conversation()
    alarm = schedule(conversation, {"n": 1})
    alarms_claim_due(limit=10)

    alarm_retry_later(alarm_id=alarm.pk, delay_s=30)

    alarm.refresh_from_db()
    assert (alarm.status, alarm.claimed_at) == ("pending", None)
    assert alarms_claim_due(limit=10) == []  # not due yet
    alarm_retry_later(alarm_id=alarm.pk, delay_s=0)
    assert alarms_claim_due(limit=10) == [alarm.pk]
    alarm.refresh_from_db()
    assert alarm.attempts == 2


@pytest.mark.django_db
def test_alarm_done_deletes_the_alarm_and_frees_its_idempotency_key() -> None:
    conversation = make_conversation()
    alarm = schedule(conversation, {"n": 1})
    alarms_claim_due(limit=10)

    alarm_done(alarm_id=alarm.pk)

    assert not Alarm.objects.filter(pk=alarm.pk).exists()
    assert schedule(conversation, {"n": 1}).pk != alarm.pk


@pytest.mark.django_db(transaction=True)
def test_alarms_claim_due_skips_an_alarm_locked_by_another_transaction() -> None:
    conversation = make_conversation()
    locked = schedule(conversation, {"n": 1}, delay_s=-10)
    free = schedule(conversation, {"n": 2}, delay_s=-5)

    with row_locked_elsewhere(Alarm, locked.pk):
        claimed = claim_without_waiting(lambda: alarms_claim_due(limit=10))

    assert claimed == [free.pk]
    assert Alarm.objects.get(pk=locked.pk).status == "pending"
    # Once the other transaction is gone the alarm is claimable again.
    assert claim_without_waiting(lambda: alarms_claim_due(limit=10)) == [locked.pk]


# --------------------------------------------------------------------------------------------------------
# 3. Detection: the beat tick
# --------------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_tick_claim_takes_a_running_fiber_with_an_expired_lease_and_bumps_its_fencing() -> None:
    conversation = make_conversation()
    add_message(conversation)
    claimed = claim(make_fiber(conversation))
    expire_lease(claimed.fiber_id)

    claims = tick_claim()

    assert claims.fibers == [claimed.fiber_id]
    fiber = fiber_row(claimed.fiber_id)
    assert (fiber.status, fiber.fencing, fiber.lease_owner) == (
        "interrupted",
        claimed.fencing + 1,
        RECOVERY_OWNER,
    )
    # The engine gets HANDLING_TTL to handle it before another tick would try again.
    assert fiber.lease_expires_at is not None and fiber.lease_expires_at > timezone.now() + HANDLING_TTL / 2


@pytest.mark.django_db
def test_tick_claim_leaves_live_leases_and_pending_fibers_alone() -> None:
    conversation, other = make_conversation(), make_conversation()
    live = claim(make_fiber(conversation))
    pending = make_fiber(other)

    assert tick_claim().fibers == []

    fiber = fiber_row(live.fiber_id)
    assert (fiber.status, fiber.fencing, fiber.lease_owner) == ("running", live.fencing, "worker-1")
    assert fiber_row(pending.pk).status == "pending"


@pytest.mark.django_db
def test_tick_claim_re_claims_an_interrupted_fiber_only_once_its_handling_deadline_passed() -> None:
    conversation = make_conversation()
    claimed = claim(make_fiber(conversation))
    expire_lease(claimed.fiber_id)
    tick_claim()

    assert tick_claim().fibers == []  # the engine is still within its handling deadline
    expire_lease(claimed.fiber_id)
    assert tick_claim().fibers == [claimed.fiber_id]
    assert fiber_row(claimed.fiber_id).fencing == claimed.fencing + 2


@pytest.mark.django_db
def test_tick_claim_returns_due_alarms_in_the_same_claim() -> None:
    conversation = make_conversation()
    alarm = schedule(conversation, {"n": 1})
    claimed = claim(make_fiber(conversation))
    expire_lease(claimed.fiber_id)

    claims = tick_claim()

    assert (claims.fibers, claims.alarms) == ([claimed.fiber_id], [alarm.pk])


@pytest.mark.django_db(transaction=True)
def test_tick_claim_skips_a_fiber_row_locked_by_another_transaction() -> None:
    locked = claim(make_fiber(make_conversation()))
    free = claim(make_fiber(make_conversation()))
    expire_lease(locked.fiber_id)
    expire_lease(free.fiber_id)

    with row_locked_elsewhere(Fiber, locked.fiber_id):
        claims = claim_without_waiting(tick_claim)

    assert claims.fibers == [free.fiber_id]
    assert (fiber_row(locked.fiber_id).status, fiber_row(locked.fiber_id).fencing) == (
        "running",
        locked.fencing,
    )
    assert claim_without_waiting(tick_claim).fibers == [locked.fiber_id]


@pytest.mark.django_db
def test_fiber_interrupt_only_acts_for_the_matching_fencing_number() -> None:
    claimed = claim(make_fiber(make_conversation()))

    assert not fiber_interrupt(fiber_id=claimed.fiber_id, fencing=claimed.fencing - 1)
    assert fiber_row(claimed.fiber_id).status == "running"
    assert fiber_interrupt(fiber_id=claimed.fiber_id, fencing=claimed.fencing)

    fiber = fiber_row(claimed.fiber_id)
    assert (fiber.status, fiber.fencing, fiber.lease_owner) == (
        "interrupted",
        claimed.fencing + 1,
        RECOVERY_OWNER,
    )
    # The old owner is fenced out: a second hand-over does nothing.
    assert not fiber_interrupt(fiber_id=claimed.fiber_id, fencing=claimed.fencing)


@pytest.mark.django_db
def test_fiber_release_only_acts_for_the_matching_fencing_number_and_lets_the_next_tick_claim() -> None:
    claimed = claim(make_fiber(make_conversation()))

    assert not fiber_release(fiber_id=claimed.fiber_id, fencing=claimed.fencing + 1)
    assert tick_claim().fibers == []
    assert fiber_release(fiber_id=claimed.fiber_id, fencing=claimed.fencing)

    assert fiber_row(claimed.fiber_id).status == "running"  # released, not yet interrupted
    assert tick_claim().fibers == [claimed.fiber_id]
    assert not fiber_release(fiber_id=claimed.fiber_id, fencing=claimed.fencing)


# --------------------------------------------------------------------------------------------------------
# 4. The stream and fencing
# --------------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_segment_append_writes_the_segment_renews_the_lease_and_credits_progress_in_one_statement() -> None:
    conversation = make_conversation(progress=4)
    claimed = claim(make_fiber(conversation))
    stream_id = open_stream(claimed)
    expire_lease(claimed.fiber_id)
    Fiber.objects.filter(pk=claimed.fiber_id).update(heartbeat_at=None)
    bodies = chunk_bodies(*PARTIAL_TEXT[:3])

    with CaptureQueriesContext(connection) as queries:
        written = append(claimed, stream_id, bodies, seq_start=0, credit=2)

    assert len(queries.captured_queries) == 1
    assert written is not None and written.cancel_requested is False
    segment = Segment.objects.get(stream_id=stream_id)
    assert (segment.seq_start, segment.seq_end, segment.fencing) == (0, 2, claimed.fencing)
    assert segment.bodies() == bodies
    fiber = fiber_row(claimed.fiber_id)
    assert fiber.heartbeat_at is not None
    assert fiber.lease_expires_at == fiber.heartbeat_at + lease_ttl()
    conversation.refresh_from_db()
    assert conversation.progress == 6


@pytest.mark.django_db
def test_segment_append_without_credit_leaves_progress_alone() -> None:
    conversation = make_conversation(progress=4)
    claimed = claim(make_fiber(conversation))

    assert append(claimed, open_stream(claimed), chunk_bodies(START), credit=0) is not None

    conversation.refresh_from_db()
    assert conversation.progress == 4


@pytest.mark.django_db
def test_segment_append_reports_a_requested_cancel() -> None:
    conversation = make_conversation()
    claimed = claim(make_fiber(conversation))
    stream_id = open_stream(claimed)
    assert fiber_request_cancel(conversation_id=conversation.pk, request_id=claimed.request_id)

    written = append(claimed, stream_id, chunk_bodies(START))

    assert written is not None and written.cancel_requested is True


@pytest.mark.django_db
def test_segment_append_after_the_fencing_number_moved_on_writes_nothing_and_returns_none() -> None:
    """The zombie rule: a worker whose fiber the tick took can write no chunk, lease or progress."""
    conversation = make_conversation(progress=1)
    claimed = claim(make_fiber(conversation))
    stream_id = open_stream(claimed)
    expire_lease(claimed.fiber_id)
    tick_claim()
    taken = fiber_row(claimed.fiber_id)

    written = append(claimed, stream_id, chunk_bodies(*PARTIAL_TEXT), credit=3)

    assert written is None
    assert not Segment.objects.filter(stream_id=stream_id).exists()
    conversation.refresh_from_db()
    assert conversation.progress == 1
    fiber = fiber_row(claimed.fiber_id)
    assert (fiber.status, fiber.lease_owner, fiber.lease_expires_at) == (
        "interrupted",
        RECOVERY_OWNER,
        taken.lease_expires_at,
    )


@pytest.mark.django_db
def test_stream_open_for_a_fenced_out_worker_raises_lease_lost() -> None:
    claimed = claim(make_fiber(make_conversation()))
    assert fiber_interrupt(fiber_id=claimed.fiber_id, fencing=claimed.fencing)

    with pytest.raises(LeaseLost):
        open_stream(claimed)
    assert not Stream.objects.exists()


@pytest.mark.django_db
def test_stream_chunks_returns_seq_and_body_in_order_across_segments_and_honours_after_seq() -> None:
    claimed = claim(make_fiber(make_conversation()))
    stream_id = open_stream(claimed)
    bodies = chunk_bodies(*PARTIAL_TEXT)
    append(claimed, stream_id, bodies[3:], seq_start=3)  # written out of order on purpose
    append(claimed, stream_id, bodies[:3], seq_start=0)

    assert stream_chunks(stream_id) == list(enumerate(bodies))
    assert stream_chunks(stream_id, after_seq=1) == list(enumerate(bodies))[2:]
    assert stream_chunks(stream_id, after_seq=3) == [(4, bodies[4])]
    assert stream_chunks(stream_id, after_seq=4) == []


@pytest.mark.django_db
def test_fiber_claim_twice_is_a_no_op_for_the_duplicate_delivery() -> None:
    fiber = make_fiber(make_conversation())
    first = claim(fiber, owner="worker-1")

    assert fiber_claim(fiber_id=fiber.pk, owner="worker-2") is None

    row = fiber_row(fiber.pk)
    assert (row.status, row.fencing, row.lease_owner) == ("running", first.fencing, "worker-1")


@pytest.mark.django_db
def test_fiber_claim_is_a_no_op_while_the_conversation_has_a_running_fiber() -> None:
    conversation = make_conversation()
    running = claim(make_fiber(conversation))
    waiting = make_fiber(conversation)

    assert fiber_claim(fiber_id=waiting.pk, owner="worker-2") is None
    assert fiber_row(waiting.pk).status == "pending"

    fiber_finish(fiber_id=running.fiber_id, fencing=running.fencing, status=Fiber.Status.COMPLETED)
    assert claim(waiting).fencing == 1


@pytest.mark.django_db
def test_fiber_claims_happen_in_acceptance_order() -> None:
    conversation = make_conversation()
    first, second = make_fiber(conversation), make_fiber(conversation)
    Fiber.objects.filter(pk=second.pk).update(created_at=F("created_at") + timedelta(seconds=1))

    assert fiber_claim(fiber_id=second.pk, owner="worker-2") is None  # an earlier turn is still queued
    first_claim = claim(first)
    fiber_finish(fiber_id=first_claim.fiber_id, fencing=first_claim.fencing, status=Fiber.Status.COMPLETED)
    assert claim(second).request_id == second.request_id


# --------------------------------------------------------------------------------------------------------
# 5. Recovery state: the snapshot, the classification and the orphan
# --------------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_load_target_only_loads_interrupted_fibers() -> None:
    conversation = make_conversation()
    running = claim(make_fiber(conversation))

    assert load_target(fiber_id=running.fiber_id) is None
    assert load_target(fiber_id=uuid.uuid4()) is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("turn_kwargs", "kind"),
    [
        pytest.param({}, "retry", id="no-stream-unanswered-user-message"),
        pytest.param({"chunks": []}, "retry", id="stream-opened-without-chunks"),
        pytest.param({"chunks": [START, START_STEP]}, "retry", id="stream-with-only-start-chunks"),
        pytest.param({"chunks": PARTIAL_TEXT}, "continue", id="partial-with-content"),
        pytest.param({"chunks": SETTLED_TOOL}, "continue", id="partial-with-a-settled-tool"),
        pytest.param({"continuation": True}, "continue", id="continuation-snapshot"),
        pytest.param({"chunks": [START], "stream_status": "completed"}, "continue", id="stream-terminal"),
        pytest.param({"chunks": [START], "stream_status": "error"}, "continue", id="stream-errored"),
        pytest.param({"answered": True}, "continue", id="user-message-already-answered"),
    ],
)
def test_recovery_target_kind(turn_kwargs: dict[str, Any], kind: str) -> None:
    turn = interrupted_turn(**turn_kwargs)

    target = load_target(fiber_id=turn.fiber_id)

    assert target is not None and target.kind == kind


@pytest.mark.django_db
def test_recovery_target_without_a_snapshot_continues() -> None:
    turn = interrupted_turn()
    Fiber.objects.filter(pk=turn.fiber_id).update(snapshot={"legacy": "stash"})

    target = load_target(fiber_id=turn.fiber_id)

    assert target is not None and target.snapshot is None
    assert (target.kind, target.recovery_data, target.root_request_id) == (
        "continue",
        {"legacy": "stash"},
        turn.request_id,
    )


@pytest.mark.django_db
def test_load_target_rebuilds_the_partial_under_the_stream_message_id() -> None:
    turn = interrupted_turn(chunks=PARTIAL_TEXT, stash={"step": 2})

    target = load_target(fiber_id=turn.fiber_id)

    assert target is not None
    assert (target.partial.message_id, target.partial.text) == ("a-stream", "Partial answer")
    assert target.last_seq == len(PARTIAL_TEXT) - 1
    assert target.recovery_data == {"step": 2}
    assert target.latest_user_message_id == turn.user_id


@pytest.mark.django_db
def test_orphan_persist_stores_the_partial_under_the_stream_message_id_and_closes_the_stream() -> None:
    turn = interrupted_turn(chunks=PARTIAL_TEXT)
    target = load_target(fiber_id=turn.fiber_id)
    assert target is not None

    messages = orphan_persist(target=target, persist=True)

    assert [m["id"] for m in messages] == [turn.user_id, "a-stream"]  # not the provider's messageId
    stored = Message.objects.get(conversation_id=turn.conversation_id, message_id="a-stream")
    assert stored.role == "assistant"
    assert [p.get("text") for p in stored.parts if p["type"] == "text"] == ["Partial answer"]
    stream = Stream.objects.get(pk=turn.stream_id)
    assert stream.status == "completed" and stream.completed_at is not None


@pytest.mark.django_db
def test_orphan_persist_with_persist_false_keeps_no_text_but_closes_the_stream() -> None:
    turn = interrupted_turn(chunks=PARTIAL_TEXT)
    target = load_target(fiber_id=turn.fiber_id)
    assert target is not None

    messages = orphan_persist(target=target, persist=False, status=Stream.Status.ERROR)

    assert [m["id"] for m in messages] == [turn.user_id]
    assert Stream.objects.get(pk=turn.stream_id).status == "error"


@pytest.mark.django_db
def test_orphan_persist_run_twice_stores_one_message() -> None:
    turn = interrupted_turn(chunks=PARTIAL_TEXT)
    target = load_target(fiber_id=turn.fiber_id)
    assert target is not None

    orphan_persist(target=target, persist=True)
    orphan_persist(target=target, persist=True)
    reloaded = load_target(fiber_id=turn.fiber_id)
    assert reloaded is not None
    messages = orphan_persist(target=reloaded, persist=True)

    assert [m["id"] for m in messages] == [turn.user_id, "a-stream"]
    assert Message.objects.filter(conversation_id=turn.conversation_id).count() == 2


@pytest.mark.django_db
def test_conversation_set_recovering_acts_only_on_a_real_transition() -> None:
    conversation = make_conversation()

    assert conversation_set_recovering(conversation_id=conversation.pk, request_id="req-1")
    assert not conversation_set_recovering(conversation_id=conversation.pk, request_id="req-2")
    conversation.refresh_from_db()
    assert conversation.recovering is not None and conversation.recovering["requestId"] == "req-1"
    assert conversation_set_recovering(conversation_id=conversation.pk, request_id=None)
    assert not conversation_set_recovering(conversation_id=conversation.pk, request_id=None)
    conversation.refresh_from_db()
    assert conversation.recovering is None


@pytest.mark.django_db
def test_a_recovering_flag_older_than_fifteen_minutes_counts_as_absent() -> None:
    stale_at = int(time.time() * 1000) - 16 * 60 * 1000
    conversation = make_conversation(recovering={"requestId": "old-req", "at": stale_at})

    changed = conversation_set_recovering(conversation_id=conversation.pk, request_id="new-req")

    conversation.refresh_from_db()
    assert changed
    assert conversation.recovering is not None and conversation.recovering["requestId"] == "new-req"


# --------------------------------------------------------------------------------------------------------
# 6. The engine: arecover_fiber end to end (async, real DB threads, real channel layer)
# --------------------------------------------------------------------------------------------------------

HOOK_CALLS: list[tuple[str, ChatRecoveryContext]] = []
EXHAUSTED: list[ExhaustedContext] = []
HOOK_ERROR = "hook exploded"
TERMINAL = "Sorry, this turn could not be recovered."


def record_exhausted(ctx: ExhaustedContext) -> None:
    EXHAUSTED.append(ctx)


def explode_on_exhausted(ctx: ExhaustedContext) -> None:
    EXHAUSTED.append(ctx)
    raise RuntimeError("on_exhausted exploded")


class EngineProbe(Think):
    """Records every on_chat_recovery context and answers with `options`."""

    options = ChatRecoveryOptions()

    async def on_chat_recovery(self, ctx: ChatRecoveryContext) -> ChatRecoveryOptions | None:
        HOOK_CALLS.append((type(self).__name__, ctx))
        return self.options


class DiscardingProbe(EngineProbe):
    options = ChatRecoveryOptions(persist=False)


class DecliningProbe(EngineProbe):
    options = ChatRecoveryOptions(continue_=False)


class FailingProbe(EngineProbe):
    async def on_chat_recovery(self, ctx: ChatRecoveryContext) -> ChatRecoveryOptions | None:
        HOOK_CALLS.append((type(self).__name__, ctx))
        raise RuntimeError(HOOK_ERROR)


class SyncProbe(EngineProbe):
    def on_chat_recovery(self, ctx: ChatRecoveryContext) -> None:  # type: ignore[override]
        HOOK_CALLS.append((type(self).__name__, ctx))


class PartsMutatingProbe(EngineProbe):
    """A hook that empties the partial parts it was handed (after reading them, say)."""

    async def on_chat_recovery(self, ctx: ChatRecoveryContext) -> ChatRecoveryOptions | None:
        HOOK_CALLS.append((type(self).__name__, ctx))
        ctx.partial_parts.clear()
        return self.options


class OneShotProbe(EngineProbe):
    chat_recovery = ChatRecovery(max_attempts=1, terminal_message=TERMINAL, on_exhausted=record_exhausted)


class NoOomProbe(EngineProbe):
    chat_recovery = ChatRecovery(max_oom_retries=0, terminal_message=TERMINAL, on_exhausted=record_exhausted)


class OneShotExplodingProbe(EngineProbe):
    chat_recovery = ChatRecovery(max_attempts=1, on_exhausted=explode_on_exhausted)


PROBES = {
    "engine-probe": EngineProbe,
    "discarding-probe": DiscardingProbe,
    "declining-probe": DecliningProbe,
    "failing-probe": FailingProbe,
    "sync-probe": SyncProbe,
    "parts-mutating-probe": PartsMutatingProbe,
    "one-shot-probe": OneShotProbe,
    "one-shot-exploding-probe": OneShotExplodingProbe,
    "no-oom-probe": NoOomProbe,
}

engine_db = pytest.mark.django_db(transaction=True)
FIRED: list[Any] = []


@pytest.fixture
def probes(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    registered = {name: f"{__name__}.{cls.__name__}" for name, cls in PROBES.items()}
    settings.THINK = {**settings.THINK, "AGENTS": {**settings.THINK["AGENTS"], **registered}}
    monkeypatch.setattr(dispatch, "fire_later", FIRED.append)  # the engine may fire a due alarm at once
    for recorded in (HOOK_CALLS, EXHAUSTED, FIRED):
        recorded.clear()
    yield
    for recorded in (HOOK_CALLS, EXHAUSTED, FIRED):
        recorded.clear()


@pytest.fixture(scope="module", autouse=True)
def close_db_thread_connections(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    """The engine's DB threads (the test loop's executor) leave connections open when their loop closes;
    end the ones opened during this module, so the per-run test database can be dropped."""

    yield from terminate_new_backends(django_db_blocker)


@dataclass
class DbState:
    conversation: Conversation
    fiber: Fiber
    incidents: list[IncidentRow]
    alarms: list[Alarm]
    messages: list[dict[str, Any]]
    stream: Stream | None

    @property
    def incident(self) -> IncidentRow:
        assert len(self.incidents) == 1, self.incidents
        return self.incidents[0]

    @property
    def texts(self) -> list[str]:
        return [p.get("text", "") for m in self.messages for p in m["parts"] if p.get("type") == "text"]


def db_state(turn: Turn) -> DbState:
    return DbState(
        conversation=Conversation.objects.get(pk=turn.conversation_id),
        fiber=Fiber.objects.get(pk=turn.fiber_id),
        incidents=list(IncidentRow.objects.filter(conversation_id=turn.conversation_id)),
        alarms=list(Alarm.objects.filter(conversation_id=turn.conversation_id).order_by("pk")),
        messages=messages_list(conversation_id=turn.conversation_id),
        stream=Stream.objects.filter(pk=turn.stream_id).first() if turn.stream_id else None,
    )


def re_interrupt(turn: Turn) -> None:
    """The same turn detected again (a second wake, another tick): interrupted once more."""
    Fiber.objects.filter(pk=turn.fiber_id).update(status=Fiber.Status.INTERRUPTED, finished_at=None)


def age_incident(turn: Turn, *, by_ms: int) -> None:
    IncidentRow.objects.filter(conversation_id=turn.conversation_id).update(
        first_seen_at=F("first_seen_at") - by_ms,
        last_attempt_at=F("last_attempt_at") - by_ms,
        last_progress_at=F("last_progress_at") - by_ms,
    )


def hook_contexts() -> list[ChatRecoveryContext]:
    return [ctx for _, ctx in HOOK_CALLS]


def the_queued_alarm(state: DbState, callback: str) -> Alarm:
    """Exactly one idempotent alarm for the callback, due now: still pending for the tick, or already
    claimed and handed to the fire_alarm task exactly once (the engine may fire a due alarm at once)."""
    [alarm] = state.alarms
    assert alarm.callback == callback
    assert alarm.idempotency_key is not None
    assert alarm.due_at <= timezone.now()
    if alarm.status == Alarm.Status.RUNNING:
        assert (FIRED, alarm.attempts) == ([alarm.pk], 1)
    else:
        assert (alarm.status, FIRED) == (Alarm.Status.PENDING, [])
    return alarm


@engine_db
async def test_recover_fiber_schedules_a_retry_for_an_interrupted_pre_stream_turn(probes: None) -> None:
    turn = await db(interrupted_turn, agent="engine-probe", last_body={"temperature": 0})

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    incident = state.incident
    assert (incident.incident_id, incident.attempt, incident.status) == (turn.incident_id, 1, "scheduled")
    assert (incident.recovery_kind, incident.max_attempts) == ("retry", 10)
    alarm = the_queued_alarm(state, RETRY_CALLBACK)
    assert alarm.payload == {
        "originalRequestId": turn.request_id,
        "incidentId": turn.incident_id,
        "lastBody": {"temperature": 0},
        "lastClientTools": None,
        "targetUserId": turn.user_id,
    }
    assert state.conversation.recovering is not None
    assert state.conversation.recovering["requestId"] == turn.request_id
    assert state.fiber.status == "recovered" and state.fiber.finished_at is not None
    assert state.fiber.lease_expires_at is None
    assert [m["id"] for m in state.messages] == [turn.user_id]


@engine_db
async def test_recover_fiber_hands_the_hook_the_full_context(probes: None) -> None:
    turn = await db(interrupted_turn, agent="engine-probe", chunks=PARTIAL_TEXT, stash={"step": 2})

    await arecover_fiber(turn.fiber_id)

    [(probe, ctx)] = HOOK_CALLS
    assert probe == "EngineProbe"
    assert (ctx.incident_id, ctx.request_id, ctx.recovery_root_request_id) == (
        turn.incident_id,
        turn.request_id,
        turn.request_id,
    )
    assert (ctx.attempt, ctx.max_attempts, ctx.recovery_kind) == (1, 10, "continue")
    assert (ctx.stream_id, ctx.partial_text, ctx.recovery_data) == (
        str(turn.stream_id),
        "Partial answer",
        {"step": 2},
    )
    assert [m["id"] for m in ctx.messages] == [turn.user_id]  # the transcript before the orphan is stored
    assert abs(ctx.created_at - time.time() * 1000) < 60_000


@engine_db
async def test_recover_fiber_retries_an_opened_but_empty_stream(probes: None) -> None:
    turn = await db(interrupted_turn, agent="engine-probe", chunks=[START, START_STEP])

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert the_queued_alarm(state, RETRY_CALLBACK).payload["targetUserId"] == turn.user_id
    assert state.incident.recovery_kind == "retry"
    assert [m["id"] for m in state.messages] == [turn.user_id]  # nothing to persist: no empty assistant
    assert state.stream is not None and state.stream.status == "completed"


@engine_db
async def test_recover_fiber_persists_the_partial_and_schedules_a_continue(probes: None) -> None:
    turn = await db(interrupted_turn, agent="engine-probe", chunks=PARTIAL_TEXT)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert [m["id"] for m in state.messages] == [turn.user_id, "a-stream"]
    assert "Partial answer" in state.texts
    assert state.stream is not None and state.stream.status == "completed"
    alarm = the_queued_alarm(state, CONTINUE_CALLBACK)
    assert alarm.payload == {
        "originalRequestId": turn.request_id,
        "incidentId": turn.incident_id,
        "lastBody": None,
        "lastClientTools": None,
        "targetAssistantId": "a-stream",
    }
    assert (state.incident.status, state.incident.recovery_kind) == ("scheduled", "continue")
    assert state.conversation.recovering is not None
    assert state.fiber.status == "recovered"


@engine_db
async def test_recover_fiber_again_within_the_debounce_spends_no_attempt_and_adds_no_alarm(
    probes: None,
) -> None:
    turn = await db(interrupted_turn, agent="engine-probe")
    await arecover_fiber(turn.fiber_id)
    first = await db(db_state, turn)

    await db(re_interrupt, turn)
    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert (state.incident.attempt, state.incident.status) == (1, "scheduled")
    assert the_queued_alarm(state, RETRY_CALLBACK).pk == first.alarms[0].pk
    assert state.incident.first_seen_at == first.incident.first_seen_at
    assert state.conversation.recovering == first.conversation.recovering  # no second transition
    assert [ctx.attempt for ctx in hook_contexts()] == [1, 1]
    assert state.fiber.status == "recovered"


@engine_db
async def test_recover_fiber_again_after_the_debounce_spends_an_attempt_but_keeps_one_alarm(
    probes: None,
) -> None:
    turn = await db(interrupted_turn, agent="engine-probe")
    await arecover_fiber(turn.fiber_id)

    await db(age_incident, turn, by_ms=INCIDENT_DEBOUNCE_MS + 1_000)
    await db(re_interrupt, turn)
    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert state.incident.attempt == 2
    the_queued_alarm(state, RETRY_CALLBACK)
    assert [ctx.attempt for ctx in hook_contexts()] == [1, 2]


def seed_spent_incident(turn: Turn) -> None:
    """An incident that already used its one attempt, more than 30 s ago (outside the debounce)."""
    now = int(time.time() * 1000)
    incident_save(
        conversation_id=turn.conversation_id,
        incident=incident_record(
            incident_id=turn.incident_id,
            request_id=turn.request_id,
            recovery_root_request_id=turn.request_id,
            max_attempts=1,
            first_seen_at=now - 120_000,
            last_attempt_at=now - 60_000,
            last_progress_at=now - 60_000,
        ),
    )


@engine_db
async def test_recover_fiber_with_an_exhausted_budget_gives_up_without_calling_the_hook(probes: None) -> None:
    turn = await db(interrupted_turn, agent="one-shot-probe", chunks=PARTIAL_TEXT)
    await db(seed_spent_incident, turn)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert state.alarms == [] and FIRED == []
    assert (state.incident.status, state.incident.reason, state.incident.attempt) == (
        "exhausted",
        "max_attempts_exceeded",
        2,
    )
    assert state.conversation.last_terminal == {"requestId": turn.request_id, "body": TERMINAL}
    assert state.conversation.recovering is None
    # The partial is kept as a normal assistant message; the terminal message never enters the transcript.
    assert [m["id"] for m in state.messages] == [turn.user_id, "a-stream"]
    assert all(TERMINAL not in text for text in state.texts)
    assert state.stream is not None and state.stream.status == "completed"
    assert HOOK_CALLS == []
    [ctx] = EXHAUSTED
    assert (ctx.incident_id, ctx.reason, ctx.attempt, ctx.max_attempts) == (
        turn.incident_id,
        "max_attempts_exceeded",
        2,
        1,
    )
    assert (ctx.partial_text, ctx.stream_id, ctx.terminal_message) == (
        "Partial answer",
        str(turn.stream_id),
        TERMINAL,
    )
    assert state.fiber.status == "recovered"


@engine_db
async def test_a_throwing_on_exhausted_is_swallowed_and_the_terminal_is_still_recorded(probes: None) -> None:
    turn = await db(interrupted_turn, agent="one-shot-exploding-probe")
    await db(seed_spent_incident, turn)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert len(EXHAUSTED) == 1
    assert state.conversation.last_terminal == {
        "requestId": turn.request_id,
        "body": DEFAULT_TERMINAL_MESSAGE,
    }
    assert (state.incident.status, state.incident.reason) == ("exhausted", "max_attempts_exceeded")
    assert (state.alarms, FIRED) == ([], [])
    assert state.fiber.status == "recovered"


@engine_db
async def test_a_raising_on_chat_recovery_marks_the_incident_failed_and_re_raises(probes: None) -> None:
    turn = await db(interrupted_turn, agent="failing-probe", chunks=PARTIAL_TEXT)

    with pytest.raises(RuntimeError, match=HOOK_ERROR):
        await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert (state.incident.status, state.incident.reason) == ("failed", HOOK_ERROR)
    assert state.alarms == [] and FIRED == []
    assert state.conversation.recovering is None
    # Left for a later tick: the fiber stays interrupted and the orphan is untouched.
    assert state.fiber.status == "interrupted"
    assert state.stream is not None and state.stream.status == "streaming"
    assert [m["id"] for m in state.messages] == [turn.user_id]


@engine_db
async def test_persist_false_drops_the_partial_text_but_still_continues(probes: None) -> None:
    turn = await db(interrupted_turn, agent="discarding-probe", chunks=PARTIAL_TEXT)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert [m["id"] for m in state.messages] == [turn.user_id]
    assert state.stream is not None and state.stream.status == "completed"
    alarm = the_queued_alarm(state, CONTINUE_CALLBACK)
    assert "targetAssistantId" not in alarm.payload  # the leaf is still the user message


@engine_db
async def test_persist_false_still_keeps_settled_tool_results(probes: None) -> None:
    turn = await db(interrupted_turn, agent="discarding-probe", chunks=SETTLED_TOOL)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert [m["id"] for m in state.messages] == [turn.user_id, "a-stream"]
    [tool_part] = [p for p in state.messages[-1]["parts"] if p["type"] == "tool-weather"]
    assert (tool_part["state"], tool_part["output"]) == ("output-available", {"temp": 3})
    assert the_queued_alarm(state, CONTINUE_CALLBACK).payload["targetAssistantId"] == "a-stream"


@engine_db
async def test_continue_false_skips_the_incident_and_records_the_declined_terminal(probes: None) -> None:
    turn = await db(interrupted_turn, agent="declining-probe", chunks=PARTIAL_TEXT)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert state.alarms == [] and FIRED == []
    assert (state.incident.status, state.incident.reason) == ("skipped", "continue_disabled")
    assert state.conversation.last_terminal == {"requestId": turn.request_id, "body": DECLINED_MESSAGE}
    assert state.conversation.recovering is None
    assert [m["id"] for m in state.messages] == [turn.user_id, "a-stream"]  # persist defaults to True
    assert all(DECLINED_MESSAGE not in text for text in state.texts)
    assert state.fiber.status == "recovered"


@engine_db
async def test_a_terminal_stream_is_skipped_and_nothing_is_scheduled(probes: None) -> None:
    turn = await db(interrupted_turn, agent="engine-probe", chunks=PARTIAL_TEXT, stream_status="completed")

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert state.alarms == [] and FIRED == []
    assert (state.incident.status, state.incident.reason, state.incident.recovery_kind) == (
        "skipped",
        "stream_terminal",
        "continue",
    )
    assert state.conversation.recovering is None and state.conversation.last_terminal is None
    assert [ctx.recovery_kind for ctx in hook_contexts()] == ["continue"]
    assert state.fiber.status == "recovered"


@engine_db
async def test_a_sync_hook_returning_none_gets_the_default_options(probes: None) -> None:
    turn = await db(interrupted_turn, agent="sync-probe", chunks=PARTIAL_TEXT)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert [name for name, _ in HOOK_CALLS] == ["SyncProbe"]
    assert [m["id"] for m in state.messages] == [turn.user_id, "a-stream"]
    the_queued_alarm(state, CONTINUE_CALLBACK)


@engine_db
async def test_a_hook_mutating_its_context_cannot_change_the_stored_partial(probes: None) -> None:
    turn = await db(interrupted_turn, agent="parts-mutating-probe", chunks=PARTIAL_TEXT)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert [m["id"] for m in state.messages] == [turn.user_id, "a-stream"]
    assert "Partial answer" in state.texts
    assert the_queued_alarm(state, CONTINUE_CALLBACK).payload["targetAssistantId"] == "a-stream"


@engine_db
async def test_recover_fiber_ignores_a_fiber_that_is_not_interrupted(probes: None) -> None:
    def running_turn() -> Turn:
        conversation = make_conversation(agent="engine-probe")
        user_id = add_message(conversation)
        claimed = claim(make_fiber(conversation))
        return Turn(conversation.pk, claimed.fiber_id, claimed.request_id, user_id)

    turn = await db(running_turn)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert (state.incidents, state.alarms, HOOK_CALLS) == ([], [], [])
    assert state.fiber.status == "running"


def lose_worker(turn: Turn) -> None:
    """What the task_failure handler records when Celery reports the pool child lost (SIGKILL/OOM)."""
    Fiber.objects.filter(pk=turn.fiber_id).update(interruption="worker_lost")


@engine_db
async def test_a_lost_worker_spends_the_oom_budget_and_recovery_goes_on(probes: None) -> None:
    turn = await db(interrupted_turn, agent="engine-probe", chunks=PARTIAL_TEXT)
    await db(lose_worker, turn)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert state.incident.oom_attempts == 1 and state.incident.status == "scheduled"
    assert len(state.alarms) == 1 and len(HOOK_CALLS) == 1


@engine_db
async def test_a_lost_worker_past_max_oom_retries_seals_the_turn_with_out_of_memory(probes: None) -> None:
    turn = await db(interrupted_turn, agent="no-oom-probe", chunks=PARTIAL_TEXT)
    await db(lose_worker, turn)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert (state.incident.status, state.incident.reason, state.incident.oom_attempts) == (
        "exhausted",
        "out_of_memory",
        1,
    )
    assert state.alarms == [] and HOOK_CALLS == []
    [ctx] = EXHAUSTED
    assert ctx.reason == "out_of_memory"
    assert state.conversation.last_terminal == {"requestId": turn.request_id, "body": TERMINAL}


@engine_db
async def test_a_silent_death_does_not_count_as_out_of_memory(probes: None) -> None:
    turn = await db(interrupted_turn, agent="no-oom-probe", chunks=PARTIAL_TEXT)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert state.incident.oom_attempts == 0 and state.incident.status == "scheduled"


# --------------------------------------------------------------------------------------------------------
# 7. A transient model error (chat.turn.errors): recovered after a wait, by the tick
# --------------------------------------------------------------------------------------------------------


def fail_transiently(turn: Turn, kind: str = "transient") -> None:
    """What the turn runner records when it hands a rate-limited or failed model call to recovery."""
    Fiber.objects.filter(pk=turn.fiber_id).update(interruption=kind)


@engine_db
async def test_a_transient_model_error_is_continued_after_a_wait_by_the_tick(probes: None) -> None:
    turn = await db(interrupted_turn, agent="engine-probe", chunks=PARTIAL_TEXT)
    await db(fail_transiently, turn)
    before = timezone.now()

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    [alarm] = state.alarms
    assert alarm.callback == CONTINUE_CALLBACK and alarm.status == Alarm.Status.PENDING
    assert alarm.due_at >= before + timedelta(seconds=1), "the first wait is a second"
    assert FIRED == [], "not fired at once: the tick fires it when it is due"
    assert alarm.idempotency_key is None
    assert "Partial answer" in state.texts, "the partial is stored before the wait"
    assert state.incident.status == "scheduled" and len(HOOK_CALLS) == 1
    assert state.conversation.recovering is not None


@engine_db
async def test_a_rate_limit_waits_at_least_its_retry_after(probes: None) -> None:
    turn = await db(interrupted_turn, agent="engine-probe")
    await db(fail_transiently, turn, "rate_limit")
    before = timezone.now()

    await arecover_fiber(turn.fiber_id, retry_after_s=20)

    [alarm] = (await db(db_state, turn)).alarms
    assert alarm.callback == RETRY_CALLBACK
    assert before + timedelta(seconds=20) <= alarm.due_at <= timezone.now() + timedelta(seconds=20)


@engine_db
async def test_a_transient_handoff_is_not_swallowed_by_the_alarm_that_started_the_failing_turn(
    probes: None,
) -> None:
    turn = await db(interrupted_turn, agent="engine-probe")
    payload = {
        "originalRequestId": turn.request_id,
        "incidentId": turn.incident_id,
        "lastBody": None,
        "lastClientTools": None,
        "targetUserId": turn.user_id,
    }
    # The retry alarm that started this turn is still running (its row goes once its callback returns).
    running = await db(
        alarm_schedule,
        conversation_id=turn.conversation_id,
        callback=RETRY_CALLBACK,
        payload=payload,
        idempotent=True,
    )
    await Alarm.objects.filter(pk=running.pk).aupdate(status=Alarm.Status.RUNNING)
    await db(fail_transiently, turn)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert [a.status for a in state.alarms] == [Alarm.Status.RUNNING, Alarm.Status.PENDING]
    assert state.alarms[1].payload == payload


@engine_db
async def test_a_transient_model_error_past_the_budget_gives_up_with_the_terminal_message(
    probes: None,
) -> None:
    turn = await db(interrupted_turn, agent="one-shot-probe", chunks=PARTIAL_TEXT)
    await db(fail_transiently, turn)
    await arecover_fiber(turn.fiber_id)
    await db(age_incident, turn, by_ms=INCIDENT_DEBOUNCE_MS + 1)
    await db(re_interrupt, turn)

    await arecover_fiber(turn.fiber_id)

    state = await db(db_state, turn)
    assert (state.incident.status, state.incident.reason) == ("exhausted", "max_attempts_exceeded")
    assert state.conversation.last_terminal == {"requestId": turn.request_id, "body": TERMINAL}
    assert "Partial answer" in state.texts, "what was stored stays"
    assert len(state.alarms) == 1, "only the first wait was scheduled"
