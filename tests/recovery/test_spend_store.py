"""recovery.fibers.fiber_spend_add: one step's spend on the running fiber, fenced (a raw statement)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from recovery.fibers import fiber_spend_add
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
