"""The operator actions of recovery.operations.actions, against Postgres (no Celery worker: the
dispatch of a recovery is replaced by a recorder).

Sync tests run inside one transaction, where Postgres' `now()` is the transaction's start: expired leases
are therefore put minutes into the past. Give-ups run on the process loop's DB threads, so those tests
use `transaction=True`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from chat.models import Conversation
from chat.transcript.snapshot import TurnKind
from chat.turn.interrupted import CONTINUE_CALLBACK, RETRY_CALLBACK
from recovery.budget.incidents import DEFAULT_TERMINAL_MESSAGE
from recovery.lease.fibers import HANDLING_TTL, RECOVERY_OWNER, fiber_claim, fiber_heartbeat
from recovery.models import Alarm, Fiber, Incident, Segment, Stream
from recovery.operations import actions
from tests.operator_support import (
    T0,
    Delays,
    GroupListener,
    add_user_message,
    delays,
    make_conversation,
    make_fiber,
    make_incident,
    recovery_alarm,
    terminate_new_backends,
)

__all__ = ["delays"]  # a fixture used by name

pytestmark = pytest.mark.django_db
EXPIRED_LONG_AGO = timedelta(minutes=-10)


@pytest.fixture(scope="module", autouse=True)
def close_db_thread_connections(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    yield from terminate_new_backends(django_db_blocker)


@pytest.fixture
def conversation() -> Conversation:
    return make_conversation()


# --------------------------------------------------------------------------------------------------------
# Force recovery
# --------------------------------------------------------------------------------------------------------


def test_forcing_a_running_fiber_claims_it_like_the_tick_and_enqueues_only_after_commit(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    fiber = make_fiber(conversation, Fiber.Status.RUNNING, lease_in=EXPIRED_LONG_AGO)
    with django_capture_on_commit_callbacks() as callbacks:
        assert actions.fiber_force_recover(fiber_id=fiber.pk) == str(fiber.pk)
        assert delays.calls == [], "nothing is enqueued before the claim commits"
    for callback in callbacks:
        callback()
    assert delays.calls == [str(fiber.pk)]
    fiber.refresh_from_db()
    assert (fiber.status, fiber.interruption, fiber.fencing, fiber.lease_owner) == (
        Fiber.Status.INTERRUPTED,
        "forced",
        4,
        RECOVERY_OWNER,
    )
    assert fiber.lease_expires_at is not None
    assert fiber.lease_expires_at > timezone.now() + HANDLING_TTL - timedelta(minutes=1)


def test_forcing_a_live_fiber_fences_out_the_worker_that_holds_it(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    fiber = Fiber.objects.create(conversation=conversation, request_id="live")
    claim = fiber_claim(fiber_id=fiber.pk, owner="worker-9")
    assert claim is not None and fiber_heartbeat(fiber_id=fiber.pk, fencing=claim.fencing).alive
    with django_capture_on_commit_callbacks(execute=True):
        actions.fiber_force_recover(fiber_id=fiber.pk)
    assert not fiber_heartbeat(fiber_id=fiber.pk, fencing=claim.fencing).alive
    assert delays.calls == [str(fiber.pk)]


def test_forcing_an_interrupted_fiber_keeps_the_reason_its_worker_recorded(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    fiber = make_fiber(conversation, Fiber.Status.INTERRUPTED, interruption="worker_lost")
    with django_capture_on_commit_callbacks(execute=True):
        actions.fiber_force_recover(fiber_id=str(fiber.pk))
    fiber.refresh_from_db()
    assert (fiber.status, fiber.interruption, fiber.fencing) == (Fiber.Status.INTERRUPTED, "worker_lost", 4)
    assert delays.calls == [str(fiber.pk)]


@pytest.mark.parametrize(
    "status",
    [
        Fiber.Status.PENDING,
        Fiber.Status.COMPLETED,
        Fiber.Status.CANCELLED,
        Fiber.Status.FAILED,
        Fiber.Status.RECOVERED,
    ],
)
def test_forcing_a_fiber_that_is_not_running_or_interrupted_is_refused(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any, status: str
) -> None:
    fiber = make_fiber(conversation, status)
    with (
        django_capture_on_commit_callbacks(execute=True),
        pytest.raises(actions.OperationRefused, match=f"is {status}: only a running or interrupted"),
    ):
        actions.fiber_force_recover(fiber_id=fiber.pk)
    fiber.refresh_from_db()
    assert (fiber.status, fiber.fencing, delays.calls) == (status, 0, [])


@pytest.mark.parametrize("fiber_id", ["not-a-uuid", "6f1c1f7e-8d5e-4c55-9a43-000000000000"])
def test_forcing_an_unknown_fiber_is_refused(fiber_id: str) -> None:
    with pytest.raises(actions.OperationRefused, match="not a fiber id|does not exist"):
        actions.fiber_force_recover(fiber_id=fiber_id)


def test_a_dry_run_names_the_fiber_and_changes_nothing(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    fiber = make_fiber(conversation, Fiber.Status.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        assert actions.fiber_force_recover(fiber_id=fiber.pk, dry_run=True) == str(fiber.pk)
    fiber.refresh_from_db()
    assert (fiber.status, fiber.fencing, delays.calls) == (Fiber.Status.RUNNING, 3, [])


def test_forcing_a_conversation_takes_its_running_and_interrupted_fibers_only(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    running = make_fiber(conversation, Fiber.Status.RUNNING)
    interrupted = make_fiber(conversation, Fiber.Status.INTERRUPTED, lease_in=timedelta(seconds=5))
    untouched = [
        make_fiber(conversation, status) for status in (Fiber.Status.PENDING, Fiber.Status.COMPLETED)
    ]
    elsewhere = make_fiber(make_conversation(), Fiber.Status.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        forced = actions.conversation_force_recover(conversation_id=conversation.pk)
    assert sorted(forced) == sorted([str(running.pk), str(interrupted.pk)])
    assert sorted(delays.calls) == sorted(forced)
    for fiber in [*untouched, elsewhere]:
        before = fiber.status
        fiber.refresh_from_db()
        assert (fiber.status, fiber.interruption) == (before, "")


def stale_fibers(conversation: Conversation) -> dict[str, Fiber]:
    return {
        "old": make_fiber(conversation, Fiber.Status.RUNNING, lease_in=timedelta(minutes=-10)),
        "recent": make_fiber(make_conversation(), Fiber.Status.RUNNING, lease_in=timedelta(seconds=-5)),
        "live": make_fiber(make_conversation(), Fiber.Status.RUNNING),
        "interrupted": make_fiber(
            make_conversation(), Fiber.Status.INTERRUPTED, lease_in=timedelta(minutes=-20)
        ),
    }


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({}, ["old", "recent"]), ({"older_than": 60}, ["old"]), ({"limit": 1}, ["old"])],
)
def test_forcing_stale_fibers_takes_running_ones_whose_lease_expired_long_enough_ago_oldest_first(
    conversation: Conversation,
    delays: Delays,
    django_capture_on_commit_callbacks: Any,
    kwargs: dict[str, Any],
    expected: list[str],
) -> None:
    fibers = stale_fibers(conversation)
    with django_capture_on_commit_callbacks(execute=True):
        forced = actions.fibers_force_recover_stale(**kwargs)
    assert forced == [str(fibers[name].pk) for name in expected]
    assert delays.calls == forced
    statuses = {name: Fiber.objects.get(pk=fiber.pk).status for name, fiber in fibers.items()}
    assert [name for name, status in statuses.items() if status == Fiber.Status.INTERRUPTED] == [
        *expected,
        "interrupted",
    ]


def test_a_stale_dry_run_lists_and_changes_nothing(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    fibers = stale_fibers(conversation)
    with django_capture_on_commit_callbacks(execute=True):
        forced = actions.fibers_force_recover_stale(dry_run=True)
    assert forced == [str(fibers["old"].pk), str(fibers["recent"].pk)]
    assert delays.calls == []
    assert Fiber.objects.get(pk=fibers["old"].pk).status == Fiber.Status.RUNNING


@pytest.mark.parametrize(("kwargs", "message"), [({"older_than": -1}, "older_than"), ({"limit": 0}, "limit")])
def test_forcing_stale_fibers_rejects_bad_bounds(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        actions.fibers_force_recover_stale(**kwargs)


# --------------------------------------------------------------------------------------------------------
# Give up, clear the recovering flag
# --------------------------------------------------------------------------------------------------------


def incident_with_pending_recovery(conversation: Conversation) -> tuple[Incident, Alarm, Fiber]:
    """An open incident whose continuation alarm is pending and whose continuation turn is queued."""
    add_user_message(conversation)
    incident = make_incident(conversation, Incident.Status.SCHEDULED)
    alarm = recovery_alarm(conversation, incident, CONTINUE_CALLBACK)
    queued = make_fiber(
        conversation,
        Fiber.Status.PENDING,
        kind=TurnKind.CONTINUE,
        snapshot={"chat": {"incidentId": incident.incident_id}},
    )
    return incident, alarm, queued


@pytest.mark.django_db(transaction=True)
def test_giving_up_on_a_conversation_seals_its_open_incident_and_sends_the_terminal_message() -> None:
    conversation = make_conversation(
        recovering={"requestId": "r", "at": int(timezone.now().timestamp() * 1000)}
    )
    incident, alarm, queued = incident_with_pending_recovery(conversation)
    other = Alarm.objects.create(
        conversation=conversation, callback="think_drain_submissions", due_at=timezone.now()
    )
    closed = make_incident(conversation, Incident.Status.SKIPPED)
    listener = GroupListener(conversation.pk)

    assert actions.conversation_give_up(conversation_id=conversation.pk) == 1

    incident.refresh_from_db()
    assert (incident.status, incident.reason) == (Incident.Status.EXHAUSTED, "forced")
    conversation.refresh_from_db()
    assert conversation.last_terminal == {"requestId": incident.request_id, "body": DEFAULT_TERMINAL_MESSAGE}
    assert conversation.recovering is None
    assert not Alarm.objects.filter(pk=alarm.pk).exists(), "the pending continuation must never start"
    assert Alarm.objects.filter(pk=other.pk).exists()
    assert Fiber.objects.get(pk=queued.pk).status == Fiber.Status.CANCELLED
    assert Incident.objects.get(pk=closed.pk).status == Incident.Status.SKIPPED
    frames = listener.frames()
    assert {
        "type": "cf_agent_use_chat_response",
        "id": incident.request_id,
        "body": DEFAULT_TERMINAL_MESSAGE,
    } in [{key: frame.get(key) for key in ("type", "id", "body")} for frame in frames]
    assert any(
        frame.get("type") == "cf_agent_chat_recovering" and not frame["recovering"] for frame in frames
    )


@pytest.mark.django_db(transaction=True)
def test_giving_up_on_one_retry_incident_drops_its_retry_alarm() -> None:
    conversation = make_conversation()
    add_user_message(conversation)
    incident = make_incident(conversation, Incident.Status.ATTEMPTING, recovery_kind="retry")
    alarm = recovery_alarm(conversation, incident, RETRY_CALLBACK)
    actions.incident_give_up(incident_pk=incident.pk)
    incident.refresh_from_db()
    assert (incident.status, incident.reason) == (Incident.Status.EXHAUSTED, "forced")
    assert not Alarm.objects.filter(pk=alarm.pk).exists()


@pytest.mark.parametrize(
    "status", [Incident.Status.EXHAUSTED, Incident.Status.FAILED, Incident.Status.SKIPPED]
)
def test_giving_up_on_an_incident_that_is_not_open_is_refused(
    conversation: Conversation, status: str
) -> None:
    incident = make_incident(conversation, status, reason="max_attempts_exceeded")
    with pytest.raises(actions.OperationRefused, match=f"is {status}, not open"):
        actions.incident_give_up(incident_pk=incident.pk)
    incident.refresh_from_db()
    assert (incident.status, conversation.last_terminal) == (status, None)


def test_giving_up_on_a_missing_incident_or_an_unconfigured_agent_is_refused() -> None:
    with pytest.raises(actions.OperationRefused, match="does not exist"):
        actions.incident_give_up(incident_pk=0)
    incident = make_incident(make_conversation(agent="retired-agent"), Incident.Status.SCHEDULED)
    with pytest.raises(actions.OperationRefused, match="retired-agent"):
        actions.incident_give_up(incident_pk=incident.pk)
    assert Incident.objects.get(pk=incident.pk).status == Incident.Status.SCHEDULED


def test_a_conversation_without_an_open_incident_has_nothing_to_give_up(conversation: Conversation) -> None:
    make_incident(conversation, Incident.Status.EXHAUSTED)
    assert actions.conversation_give_up(conversation_id=conversation.pk) == 0


@pytest.mark.parametrize("age_ms", [1_000, 20 * 60_000], ids=["active", "past-its-ttl"])
def test_clearing_a_recovering_flag_clears_it_and_tells_the_clients(age_ms: int) -> None:
    now_ms = int(timezone.now().timestamp() * 1000)
    conversation = make_conversation(recovering={"requestId": "r-1", "at": now_ms - age_ms})
    listener = GroupListener(conversation.pk)
    assert actions.conversation_clear_recovering(conversation_id=conversation.pk) is True
    conversation.refresh_from_db()
    assert conversation.recovering is None
    events = listener.events()
    assert [event["type"] for event in events] == ["think.broadcast", "think.release_parked"]
    assert json.loads(events[0]["frame"]) == {"type": "cf_agent_chat_recovering", "recovering": False}
    assert actions.conversation_clear_recovering(conversation_id=conversation.pk) is False
    assert listener.events(timeout=0.2) == [], "no second broadcast when nothing changed"


def test_clearing_the_flag_while_a_turn_is_queued_leaves_parked_clients_waiting_for_it() -> None:
    conversation = make_conversation(
        recovering={"requestId": "r-1", "at": int(timezone.now().timestamp() * 1000)}
    )
    make_fiber(conversation, Fiber.Status.PENDING)
    listener = GroupListener(conversation.pk)
    assert actions.conversation_clear_recovering(conversation_id=conversation.pk) is True
    assert [event["type"] for event in listener.events()] == ["think.broadcast"]


# --------------------------------------------------------------------------------------------------------
# Sweep, prune, report
# --------------------------------------------------------------------------------------------------------


def test_one_sweep_does_what_the_tick_does_and_returns_its_counts(
    conversation: Conversation, delays: Delays
) -> None:
    expired = make_fiber(conversation, Fiber.Status.RUNNING, lease_in=EXPIRED_LONG_AGO)
    make_fiber(make_conversation(), Fiber.Status.RUNNING)
    counts = actions.recovery_sweep()
    assert counts == {"fibers": 1, "alarms": 0, "requeued": 0, "submissions": 0, "completions": 0}
    assert delays.calls == [str(expired.pk)]
    assert Fiber.objects.get(pk=expired.pk).status == Fiber.Status.INTERRUPTED


def finished_stream(conversation: Conversation, *, minutes_ago: float, status: str = "completed") -> Stream:
    row = Stream.objects.create(conversation=conversation, request_id="r", message_id="m", status=status)
    when = timezone.now() - timedelta(minutes=minutes_ago)
    Stream.objects.filter(pk=row.pk).update(
        created_at=when, completed_at=None if status == "streaming" else when
    )
    Segment.objects.create(stream=row, seq_start=0, seq_end=0, body='{"type":"start"}', fencing=1)
    return row


def test_pruning_streams_deletes_buffers_finished_more_than_n_minutes_ago(conversation: Conversation) -> None:
    old = finished_stream(conversation, minutes_ago=11)
    recent = finished_stream(conversation, minutes_ago=5)
    abandoned = finished_stream(conversation, minutes_ago=30, status="streaming")
    assert actions.streams_prune(older_than_minutes=3, dry_run=True) == 2
    assert Stream.objects.count() == 3
    assert actions.streams_prune() == 1
    assert set(Stream.objects.values_list("pk", flat=True)) == {recent.pk, abandoned.pk}
    assert actions.streams_prune(older_than_minutes=3) == 1, "an abandoned stream keeps its hour"
    assert not Stream.objects.filter(pk=old.pk).exists() and Segment.objects.count() == 1


def test_pruning_incidents_deletes_closed_ones_untouched_for_more_than_n_days(
    conversation: Conversation,
) -> None:
    def aged(status: str, days: float) -> Incident:
        row = make_incident(conversation, status)
        Incident.objects.filter(pk=row.pk).update(updated_at=timezone.now() - timedelta(days=days))
        return row

    closed = [aged(status, 8) for status in actions.CLOSED_INCIDENTS]
    kept = [aged(Incident.Status.SCHEDULED, 30), aged(Incident.Status.EXHAUSTED, 2)]
    assert actions.incidents_prune(dry_run=True) == len(closed)
    assert Incident.objects.count() == len(closed) + len(kept)
    assert actions.incidents_prune() == len(closed)
    assert set(Incident.objects.values_list("pk", flat=True)) == {row.pk for row in kept}
    assert actions.incidents_prune(older_than_days=1) == 1


def test_the_incident_report_filters_by_status_and_shows_times_as_datetimes(
    conversation: Conversation,
) -> None:
    exhausted = make_incident(conversation, Incident.Status.EXHAUSTED, reason="no_progress_timeout")
    make_incident(conversation, Incident.Status.SKIPPED)
    [row] = actions.incidents_report(statuses=[Incident.Status.EXHAUSTED])
    assert row["incident_id"] == exhausted.incident_id
    assert row["conversation"] == str(conversation)
    assert (row["reason"], row["attempt"], row["max_attempts"]) == ("no_progress_timeout", 2, 6)
    assert (row["first_seen_at"], row["last_attempt_at"]) == (
        "2023-11-14T22:13:20+00:00",
        "2023-11-14T22:13:25+00:00",
    )
    assert actions.epoch_ms_datetime(T0) is not None and actions.epoch_ms_datetime(None) is None
