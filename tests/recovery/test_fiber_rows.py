"""The fiber rows written on every turn by raw statements: `fiber_create` and `fiber_spend_add`."""

from __future__ import annotations

from decimal import Decimal

import pytest

from recovery.lease.fibers import fiber_create, fiber_spend_add
from recovery.models import Fiber
from tests.recovery.test_engine_store import make_conversation, make_fiber

pytestmark = pytest.mark.django_db


def test_a_steps_spend_adds_up_on_the_running_fiber_and_nowhere_else() -> None:
    fiber = make_fiber(make_conversation())
    Fiber.objects.filter(pk=fiber.pk).update(status=Fiber.Status.RUNNING, fencing=3)
    step = {"input_tokens": 10, "output_tokens": 4, "cached_tokens": 2}
    assert fiber_spend_add(fiber_id=fiber.pk, fencing=3, cost=None, **step)
    assert Fiber.objects.get(pk=fiber.pk).cost is None, "an unpriced step leaves the cost unset"
    assert fiber_spend_add(fiber_id=fiber.pk, fencing=3, cost=Decimal("0.000001500000"), **step)
    assert fiber_spend_add(fiber_id=fiber.pk, fencing=3, cost=Decimal("0.25"), **step)
    spent = Fiber.objects.values_list("input_tokens", "output_tokens", "cached_tokens", "cost").get(
        pk=fiber.pk
    )
    assert spent == (30, 12, 6, Decimal("0.250001500000"))
    assert not fiber_spend_add(fiber_id=fiber.pk, fencing=2, cost=Decimal(1), **step), "fenced out"
    Fiber.objects.filter(pk=fiber.pk).update(status=Fiber.Status.INTERRUPTED)
    assert not fiber_spend_add(fiber_id=fiber.pk, fencing=3, cost=Decimal(1), **step), "no longer running"
    after = Fiber.objects.values_list("input_tokens", "output_tokens", "cached_tokens", "cost").get(
        pk=fiber.pk
    )
    assert after == spent


def test_a_created_fiber_is_the_row_the_orm_would_have_stored() -> None:
    conversation = make_conversation()
    snapshot = {"v": 1, "turn": {"requestId": "r1", "text": "ünïcode ✓"}}
    created = fiber_create(conversation_id=conversation.pk, request_id="r1", kind="chat", snapshot=snapshot)
    stored = Fiber.objects.get(pk=created.pk)
    fields = [f.attname for f in Fiber._meta.concrete_fields]
    assert [getattr(created, f) for f in fields] == [getattr(stored, f) for f in fields]
    assert (stored.status, stored.fencing, stored.snapshot) == (Fiber.Status.PENDING, 0, snapshot)
    created.error = "saved in place"
    created.save(update_fields=["error"])  # a model instance as any other
    assert Fiber.objects.get(pk=created.pk).error == "saved in place"
    other = fiber_create(conversation_id=conversation.pk, request_id="r2", kind="chat", snapshot=None)
    assert other.pk != created.pk and Fiber.objects.get(pk=other.pk).snapshot is None
