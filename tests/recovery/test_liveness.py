"""The session detector (recovery.lease.liveness, recovery.lease.fibers.fibers_take_orphaned) against real
Postgres sessions: a fiber is taken over once the process that owns it has lost its session, and never while
that session lives, while its lease is fresh, or before every worker could take its lock back."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from recovery.checks import check_recovery_deploy, check_recovery_settings
from recovery.lease import fibers, liveness
from recovery.lease.control import session_params
from recovery.lease.fibers import RECOVERY_OWNER, fiber_claim, fibers_take_orphaned
from recovery.models import Fiber
from tests.operator_support import make_conversation, make_fiber
from tests.support import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def new_key() -> int:
    return random.randrange(1, 2**62)


@contextmanager
def session_holding(key: int) -> Iterator[psycopg.Connection[Any]]:
    """Another Postgres session that holds `key`'s lock, as a live worker's liveness session does."""
    with psycopg.connect(**session_params(), autocommit=True) as held:
        held.execute("SELECT pg_advisory_lock(%s)", [key])
        yield held


def lock_held(key: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND ((classid::bigint << 32) | objid::bigint) = %s)",
            [key],
        )
        return bool(cursor.fetchone()[0])


def owned_fiber(key: int | None, *, renewed_ago: timedelta = timedelta(seconds=5)) -> Fiber:
    """A running fiber whose owner recorded `key`, its lease last renewed `renewed_ago`."""
    fiber = make_fiber(make_conversation(), Fiber.Status.RUNNING, lease_session=key)
    Fiber.objects.filter(pk=fiber.pk).update(heartbeat_at=timezone.now() - renewed_ago)
    return fiber


# A short confirmation, so that the second sighting comes soon (the default is 300 ms).
CONFIRM = {**settings.THINK, "LIVENESS_CONFIRM_MS": 50}


@pytest.fixture(autouse=True)
def two_sightings(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests' fibers were last renewed seconds ago: to see the two sightings, no lease is old enough
    to be taken at the first (the tests of that path set SETTLED_DEATH back)."""
    monkeypatch.setattr(fibers, "SETTLED_DEATH", timedelta(hours=1))


def poll() -> list[Any]:
    with override_settings(THINK=CONFIRM), transaction.atomic():
        return fibers_take_orphaned()


def after_confirmation() -> None:
    time.sleep(0.1)  # longer than CONFIRM's 50 ms: the next poll may confirm


def test_a_fiber_is_taken_over_once_its_owners_session_is_gone_and_never_while_it_lives() -> None:
    key = new_key()
    fiber = owned_fiber(key)
    with session_holding(key):
        assert poll() == []
        after_confirmation()
        assert poll() == [], "the owner's session holds its lock: it is alive"
    wait_until(lambda: not lock_held(key), 5, "the ended session's lock to be free")

    assert poll() == [], "a first sighting only marks it"
    after_confirmation()
    assert poll() == [fiber.pk], "the second one takes it over"

    fiber.refresh_from_db()
    assert fiber.status == Fiber.Status.INTERRUPTED
    assert fiber.fencing == 4 and fiber.lease_owner == RECOVERY_OWNER, "fenced, held by the engine"
    assert fiber.lease_expires_at is not None and fiber.lease_expires_at > timezone.now()
    after_confirmation()
    assert poll() == [], "taken once"


def test_an_owner_that_renews_after_the_first_sighting_keeps_its_fiber() -> None:
    """A process whose session dropped renews its leases on every flush tick until it is back."""
    fiber = owned_fiber(new_key())
    assert poll() == []
    Fiber.objects.filter(pk=fiber.pk).update(heartbeat_at=timezone.now())  # the owner's next tick
    after_confirmation()
    assert poll() == []
    after_confirmation()
    assert poll() == [], "nor is it marked again while its lease is fresh"
    Fiber.objects.filter(pk=fiber.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=1))
    assert poll() == []
    after_confirmation()
    assert poll() == [fiber.pk], "once it stops renewing for good, it is taken"


def test_an_owner_that_takes_its_key_back_keeps_its_fiber() -> None:
    key = new_key()
    owned_fiber(key)
    assert poll() == []
    with session_holding(key):
        after_confirmation()
        assert poll() == []


def test_an_owner_dead_before_anyone_looked_is_taken_at_the_first_sighting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that starts after its predecessor died (a deploy, a crash with no other worker) finds a
    lease unrenewed for longer than both sightings would take: it takes the fiber at once."""
    monkeypatch.setattr(fibers, "SETTLED_DEATH", timedelta(seconds=1))
    key = new_key()
    long_dead = owned_fiber(key, renewed_ago=timedelta(seconds=2))
    owned_fiber(None, renewed_ago=timedelta(seconds=2))  # claimed without a session: left to its lease
    with session_holding(key):
        assert poll() == [], "never while the owner's session holds its key, however old the lease"
    wait_until(lambda: not lock_held(key), 5, "the ended session's lock to be free")
    with override_settings(THINK={**CONFIRM, "LEASE_TTL_S": 10**9}), transaction.atomic():
        assert fibers_take_orphaned() == [], "nor right after Postgres started"
    recent = owned_fiber(new_key(), renewed_ago=timedelta(milliseconds=400))
    assert poll() == [long_dead.pk], "the long-dead owner's fiber, at the first sighting"
    assert poll() == [], "one renewed under SETTLED_DEATH ago is only marked"
    after_confirmation()
    assert poll() == [recent.pk]
    long_dead.refresh_from_db()
    assert long_dead.status == Fiber.Status.INTERRUPTED and long_dead.lease_owner == RECOVERY_OWNER


def test_a_fiber_claimed_without_a_session_is_left_to_its_lease() -> None:
    owned_fiber(None)
    make_fiber(make_conversation(), Fiber.Status.PENDING, lease_session=new_key())
    assert poll() == []
    after_confirmation()
    assert poll() == []


def test_right_after_postgres_started_a_free_lock_is_not_trusted() -> None:
    owned_fiber(new_key())
    # A server that started less than LEASE_TTL_S ago: nobody has had the time to take its lock back.
    with override_settings(THINK={**CONFIRM, "LEASE_TTL_S": 10**9}), transaction.atomic():
        assert fibers_take_orphaned() == []
    after_confirmation()
    with override_settings(THINK={**CONFIRM, "LEASE_TTL_S": 10**9}), transaction.atomic():
        assert fibers_take_orphaned() == []
    assert poll() == []
    after_confirmation()
    assert len(poll()) == 1


def test_two_polls_at_once_take_a_fiber_once() -> None:
    fibers = [owned_fiber(new_key()) for _ in range(6)]
    assert poll() == []
    after_confirmation()
    results: list[list[Any]] = []
    barrier = threading.Barrier(2)

    def concurrent_poll() -> None:
        barrier.wait()
        try:
            with transaction.atomic():
                results.append(fibers_take_orphaned())
        finally:
            connection.close()

    threads = [threading.Thread(target=concurrent_poll) for _ in range(2)]
    with override_settings(THINK=CONFIRM):  # once, here: overriding settings is not thread-safe
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    taken = [pk for result in results for pk in result]
    assert sorted(map(str, taken)) == sorted(str(f.pk) for f in fibers), "each exactly once"
    assert set(Fiber.objects.values_list("fencing", flat=True)) == {4}


def test_a_claim_records_the_session_it_was_given() -> None:
    fiber = make_fiber(make_conversation(), Fiber.Status.PENDING)
    claim = fiber_claim(fiber_id=fiber.pk, owner="w", session=42)
    assert claim is not None
    fiber.refresh_from_db()
    assert fiber.lease_session == 42


# -- the session of this process -------------------------------------------------------------------


@pytest.fixture
def live_session() -> Iterator[None]:
    liveness.start()
    try:
        wait_until(liveness.held.is_set, 10, "the liveness session to hold its lock")
        yield
    finally:
        liveness.stop()
        wait_until(lambda: not liveness.held.is_set(), 5, "the session to end")


def liveness_backends() -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
            [f"think-liveness:{liveness.key()}"],
        )
        return [row[0] for row in cursor.fetchall()]


def test_the_session_holds_the_processes_key_and_takes_it_back_after_a_drop(live_session: None) -> None:
    key = liveness.key()
    assert liveness.session_key() == key and lock_held(key)
    [backend] = liveness_backends()

    with connection.cursor() as cursor:  # the connection is cut (a proxy, an operator, a restart)
        cursor.execute("SELECT pg_terminate_backend(%s)", [backend])
    wait_until(lambda: not liveness.held.is_set(), 5, "the loss to be noticed")
    # Meanwhile a claim records no key, and the process renews its leases on every flush tick.
    assert liveness.session_key() is None or liveness.held.is_set()

    wait_until(liveness.held.is_set, 10, "the session to come back")
    assert liveness.key() == key and lock_held(key), "the same key, held again"
    assert not liveness.degraded()
    [again] = liveness_backends()
    assert again != backend


def test_the_poll_sees_which_liveness_sessions_are_connected(live_session: None) -> None:
    """What the poll compares from one look to the next, to run its fiber query only after a loss."""
    name = f"think-liveness:{liveness.key()}"
    assert name in liveness.live_sessions()
    liveness.stop()
    wait_until(lambda: name not in liveness.live_sessions(), 5, "the session to be gone from the list")


def test_while_its_session_is_lost_a_process_renews_every_tick(live_session: None) -> None:
    """The renewal cadence of the flusher while degraded: every tick, not every HEARTBEAT_INTERVAL_S."""
    from recovery.stream.flusher import Flusher

    liveness.held.clear()
    liveness._lost.set()
    try:
        assert liveness.degraded()
        assert Flusher._renew_after(heartbeat_s=1.0) == 0.0
    finally:
        liveness._lost.clear()
        liveness.held.set()
    assert Flusher._renew_after(heartbeat_s=1.0) == 1.0


# -- the checks ------------------------------------------------------------------------------------


def ids(settings: Any, **think: Any) -> list[str]:
    settings.THINK = {**settings.THINK, "METRICS_TOKEN": "t", **think}
    return [message.id or "" for message in [*check_recovery_settings(), *check_recovery_deploy()]]


def test_the_checks_say_which_detector_is_in_force(settings: Any) -> None:
    assert ids(settings) == ["think_recovery.I001"], "manage.py check --deploy"
    assert check_recovery_settings() == [], "not on every manage.py command"
    assert ids(settings, LIVENESS_SESSIONS=False) == ["think_recovery.W002"]
    assert ids(settings, LIVENESS_SESSIONS="yes") == ["think_recovery.E006"]
    assert ids(settings, LIVENESS_SESSIONS=True, LIVENESS_DATABASE="replica") == ["think_recovery.E007"]
    assert ids(settings, LIVENESS_DATABASE="default", LIVENESS_CONFIRM_MS=150) == [
        "think_recovery.E008",
        "think_recovery.I001",
    ]
    assert ids(settings, LIVENESS_CONFIRM_MS=300, LIVENESS_POLL_MS=0) == ["think_recovery.I001"], "tick only"
    assert ids(settings, LIVENESS_POLL_MS=-250) == ["think_recovery.E001", "think_recovery.I001"]


def test_a_pooler_in_front_of_the_liveness_session_is_reported(settings: Any) -> None:
    settings.DATABASES = {**settings.DATABASES, "pooled": {**settings.DATABASES["default"], "PORT": "6432"}}
    assert ids(settings, LIVENESS_DATABASE="pooled") == ["think_recovery.W003", "think_recovery.I001"]


def test_a_process_that_does_not_judge_takes_no_fibers_until_it_does(live_session: None) -> None:
    """A worker parked on, or serving, other queues than the one recovery work is sent to holds its
    session but leaves the dead to the workers of that queue; once it consumes it, it judges."""
    orphan = owned_fiber(new_key())
    fencing = orphan.fencing
    asked: list[bool] = []
    judging = threading.Event()

    def judges() -> bool:
        asked.append(judging.is_set())
        return judging.is_set()

    liveness.start(judges=judges)
    wait_until(lambda: len(asked) >= 4, 10, "four polls")
    orphan.refresh_from_db()
    assert (orphan.status, orphan.fencing) == (Fiber.Status.RUNNING, fencing), "nobody's fiber taken"
    judging.set()
    wait_until(lambda: Fiber.objects.get(pk=orphan.pk).fencing > fencing, 10, "the orphan to be taken over")


def test_a_worker_judges_while_it_consumes_the_queue_recovery_work_goes_to() -> None:
    from types import SimpleNamespace

    from recovery.tasks import _consumes_recovery_queue

    tasks = SimpleNamespace(queues={"parked"}, consuming_from=lambda name: name in tasks.queues)
    app = SimpleNamespace(conf=SimpleNamespace(task_default_queue="turns"))
    consumer = SimpleNamespace(app=app, task_consumer=tasks)
    judges = _consumes_recovery_queue(consumer)
    assert judges is not None and not judges()
    tasks.queues.add("turns")  # add_consumer, as a hand-over does
    assert judges()
    consumer.task_consumer = None  # between a lost broker connection and the next
    assert not judges()
    assert _consumes_recovery_queue(None) is None, "no consumer to ask: every poll judges"
