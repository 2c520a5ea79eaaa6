"""The session detector with real worker processes (recovery.lease.liveness): a killed worker's turn is
taken over by its lost session long before its lease could lapse, and a live worker never loses a turn
to it: not in a pause, not behind a slow provider, not when its own session is cut and comes back."""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from recovery.models import Fiber, Incident
from tests.support import ChatClient, chat_request, follow_conversation, numbers, user_message, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# A lease that cannot lapse within any of these tests: whatever takes a turn over here, it is not the
# lease. (The heartbeat stays at its 1 s: quiet turns renew seldom, as in production.)
LONG_LEASE = {"THINK_TEST_LEASE_TTL_S": "120"}


@pytest.fixture(autouse=True)
def own_workers(recovery_stack: Any) -> Any:
    yield
    recovery_stack.stop_workers()


async def start_turn(client: ChatClient, text: str) -> str:
    request_id = uuid.uuid4().hex[:10]
    await client.send(chat_request(request_id, [user_message(text)]))
    return request_id


def chunks_of(request_id: str, at_least: int) -> Any:
    return lambda log: len(log.stream(request_id).chunks) >= at_least


def owner_of(workers: list[Any], fiber: Fiber) -> Any:
    pid = fiber.lease_owner.split(":")[1]
    return next(w for w in workers if str(w.popen.pid) == pid)


def liveness_backends(key: int) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", [f"think-liveness:{key}"]
        )
        return [row[0] for row in cursor.fetchall()]


async def one_fiber_and_no_incident(request_id: str) -> Fiber:
    """The turn ran to its end on the fiber it started with: nobody took it over."""
    fibers = [f async for f in Fiber.objects.filter(request_id=request_id)]
    assert len(fibers) == 1 and fibers[0].status == Fiber.Status.COMPLETED, [
        (f.status, f.fencing) for f in fibers
    ]
    assert fibers[0].fencing == 1, "never fenced: no takeover"
    assert not await Incident.objects.filter(request_id=request_id).aexists()
    return fibers[0]


async def test_a_killed_worker_is_noticed_by_its_lost_session(recovery_stack: Any) -> None:
    workers = [recovery_stack.start_worker(env=LONG_LEASE) for _ in range(2)]
    name = f"live-kill-{uuid.uuid4().hex[:8]}"
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, "count to 60 [rate 25]")
        log = await follow_conversation(client, until=chunks_of(request_id, 15), timeout=30)
        fiber = await Fiber.objects.aget(request_id=request_id)
        assert fiber.lease_session is not None, "the claim recorded its process's liveness key"
        assert await sync_to_async(liveness_backends)(fiber.lease_session), "held by a live session"
        owner_of(workers, fiber).kill(signal.SIGKILL)
        # The lease has two minutes left: only the lost session can hand the turn over this soon.
        await follow_conversation(client, log, timeout=30)
    fiber = await Fiber.objects.aget(request_id=request_id)
    assert fiber.status == Fiber.Status.RECOVERED and fiber.fencing == 2
    assert log.text == numbers(60)
    assert len(log.order) == 2, "one continuation"


async def test_a_short_pause_keeps_the_turn(recovery_stack: Any) -> None:
    """A worker stopped for longer than the confirmation (a long GC pause, a starved host) still holds
    its session: nothing takes its turn, which goes on when it wakes."""
    worker = recovery_stack.start_worker(env=LONG_LEASE)
    recovery_stack.start_worker(env=LONG_LEASE)  # a live worker whose poll would take the turn
    name = f"live-pause-{uuid.uuid4().hex[:8]}"
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, "count to 40 [rate 20]")
        log = await follow_conversation(client, until=chunks_of(request_id, 10), timeout=30)
        fiber = await Fiber.objects.aget(request_id=request_id)
        paused = owner_of(recovery_stack.workers, fiber)
        assert paused is worker or paused in recovery_stack.workers
        paused.signal(signal.SIGSTOP)
        await asyncio.sleep(2.5)  # eight confirmations, ten polls of the other worker
        paused.signal(signal.SIGCONT)
        await follow_conversation(client, log, timeout=30)
    await one_fiber_and_no_incident(request_id)
    assert log.text == numbers(40)


async def test_a_slow_provider_keeps_the_turn(recovery_stack: Any) -> None:
    """A model that sends a token a second leaves the lease unrenewed for longer than the confirmation
    between heartbeats; the owner's session is what says it is alive."""
    recovery_stack.start_worker(env=LONG_LEASE)
    recovery_stack.start_worker(env=LONG_LEASE)
    name = f"live-slow-{uuid.uuid4().hex[:8]}"
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, "count to 5 [rate 1]")
        log = await follow_conversation(client, timeout=30)
    await one_fiber_and_no_incident(request_id)
    assert log.text == numbers(5)


async def test_a_cut_liveness_session_comes_back_without_losing_the_turn(recovery_stack: Any) -> None:
    recovery_stack.start_worker(env=LONG_LEASE)
    recovery_stack.start_worker(env=LONG_LEASE)
    name = f"live-cut-{uuid.uuid4().hex[:8]}"
    async with ChatClient(recovery_stack.port, name) as client:
        request_id = await start_turn(client, "count to 30 [rate 5]")
        log = await follow_conversation(client, until=chunks_of(request_id, 3), timeout=30)
        fiber = await Fiber.objects.aget(request_id=request_id)
        key = fiber.lease_session
        assert key is not None
        [backend] = await sync_to_async(liveness_backends)(key)

        def cut() -> None:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [backend])

        await sync_to_async(cut)()
        await sync_to_async(wait_until)(
            lambda: liveness_backends(key) not in ([], [backend]), 10, "the session to come back"
        )
        await follow_conversation(client, log, timeout=30)
    await one_fiber_and_no_incident(request_id)
    assert log.text == numbers(30)
