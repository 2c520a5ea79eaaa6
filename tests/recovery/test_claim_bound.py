"""Hundreds of interrupted fibers are taken over in bounded batches (THINK["RECOVERY_CLAIMS_PER_TICK"]):
by the beat's tick (lapsed leases, lost sessions) and by a worker's liveness poll, each call taking at
most the bound, every fiber taken exactly once in the end. bench/claim_burst.py measures the drain."""

from __future__ import annotations

import random
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

import recovery.tasks
from chat.models import Conversation
from recovery.checks import check_recovery_settings
from recovery.engine.detection import tick_claim
from recovery.lease import liveness
from recovery.lease.fibers import RECOVERY_OWNER
from recovery.models import Fiber
from recovery.process import dispatch

BOUND = 40
FIBERS = 300


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fibers handed to the engine (dispatch.recover_later), recorded instead of sent to the broker."""
    handed: list[str] = []
    monkeypatch.setattr(dispatch, "recover_later", handed.append)
    return handed


def expired_fibers(count: int, **fields: Any) -> set[Any]:
    """`count` running fibers, one per conversation, whose lease lapsed a minute ago (a dead worker's)."""
    past = timezone.now() - timedelta(minutes=1)
    conversations = Conversation.objects.bulk_create(
        Conversation(agent="assistant", name=f"burst-{uuid.uuid4().hex[:10]}") for _ in range(count)
    )
    fibers = Fiber.objects.bulk_create(
        Fiber(
            conversation=conversation,
            request_id=f"req-{uuid.uuid4().hex[:8]}",
            status=Fiber.Status.RUNNING,
            fencing=1,
            lease_owner="dead-worker",
            lease_expires_at=past,
            heartbeat_at=past,
            **fields,
        )
        for conversation in conversations
    )
    return {fiber.pk for fiber in fibers}


def drain(take: Any, expected: set[Any]) -> list[int]:
    """Call `take` until every expected fiber was taken; the number taken by each call."""
    taken: list[Any] = []
    per_call: list[int] = []
    for _ in range(4 * len(expected) // BOUND + 10):
        batch = take()
        per_call.append(len(batch))
        taken.extend(batch)
        if set(taken) >= expected:
            break
    assert set(taken) == expected, f"{len(expected - set(taken))} fibers were never taken over"
    assert len(taken) == len(set(taken)), "a fiber was taken over twice"
    assert Fiber.objects.filter(pk__in=expected, status=Fiber.Status.INTERRUPTED).count() == len(expected)
    assert set(Fiber.objects.filter(pk__in=expected).values_list("lease_owner", flat=True)) == {
        RECOVERY_OWNER
    }
    return per_call


@pytest.mark.django_db
def test_the_tick_takes_over_lapsed_leases_in_batches_of_the_bound(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "RECOVERY_CLAIMS_PER_TICK": BOUND}
    fibers = expired_fibers(FIBERS)

    per_tick = drain(lambda: tick_claim().fibers, fibers)

    assert max(per_tick) <= BOUND, per_tick
    assert len(per_tick) >= FIBERS // BOUND, per_tick


@pytest.mark.django_db
def test_the_recovery_tick_task_hands_out_at_most_the_bound(settings: Any, sent: list[str]) -> None:
    """The beat's task itself, with what it sends to the broker recorded instead."""
    settings.THINK = {**settings.THINK, "RECOVERY_CLAIMS_PER_TICK": BOUND}
    fibers = expired_fibers(FIBERS)

    def tick() -> list[Any]:
        before = len(sent)
        assert recovery.tasks.recovery_tick()["fibers"] == len(sent) - before
        return [uuid.UUID(fiber_id) for fiber_id in sent[before:]]

    per_tick = drain(tick, fibers)

    assert max(per_tick) <= BOUND, per_tick


@pytest.mark.django_db(transaction=True)
def test_a_liveness_poll_takes_over_a_dead_processes_fibers_in_batches_of_the_bound(sent: list[str]) -> None:
    """Fibers whose owner's session is gone (nobody holds their key): each poll marks and takes at most
    the bound, as a worker's poll does when it starts beside hundreds of them."""
    dead_key = random.randrange(1, 2**62)
    fibers = expired_fibers(FIBERS, lease_session=dead_key)
    # A lease that has not lapsed: only the session detector can see these.
    Fiber.objects.filter(pk__in=fibers).update(lease_expires_at=timezone.now() + timedelta(hours=1))
    think = {**settings.THINK, "RECOVERY_CLAIMS_PER_TICK": BOUND, "LIVENESS_CONFIRM_MS": 1}

    with override_settings(THINK=think):
        per_poll = drain(lambda: liveness.take_orphaned(), fibers)

    assert max(per_poll) <= BOUND, per_poll
    assert sorted(sent) == sorted(str(pk) for pk in fibers)


@pytest.mark.django_db
def test_the_tick_shares_its_bound_between_lost_sessions_and_lapsed_leases(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "RECOVERY_CLAIMS_PER_TICK": BOUND, "LIVENESS_CONFIRM_MS": 1}
    dead_key = random.randrange(1, 2**62)
    orphaned = expired_fibers(BOUND, lease_session=dead_key)
    Fiber.objects.filter(pk__in=orphaned).update(lease_expires_at=timezone.now() + timedelta(hours=1))
    Fiber.objects.filter(pk__in=orphaned).update(lease_lost_at=timezone.now() - timedelta(seconds=30))
    lapsed = expired_fibers(BOUND)
    with transaction.atomic():
        first = tick_claim().fibers
    assert len(first) == BOUND and set(first) == orphaned, "the confirmed orphans, and no more"
    assert set(tick_claim().fibers) == lapsed


def test_the_bound_is_a_positive_whole_number(settings: Any) -> None:
    for wrong in (0, -5, 2.5, True, None, "50"):
        settings.THINK = {**settings.THINK, "RECOVERY_CLAIMS_PER_TICK": wrong}
        assert [m.id for m in check_recovery_settings()] == ["think_recovery.E001"], wrong
    settings.THINK = {**settings.THINK, "RECOVERY_CLAIMS_PER_TICK": 50}
    assert check_recovery_settings() == []
