"""Helpers for the operator tests (operations, commands, admin): rows in a given state, a channel-layer
listener, and the cleanup of connections left by the process loop's database threads."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from channels.layers import get_channel_layer
from django.db import connection
from django.utils import timezone

from chat.broadcast import group_name
from chat.models import Conversation, Message
from recovery.models import Alarm, Fiber, Incident

T0 = 1_700_000_000_000  # 2023-11-14 22:13:20 UTC, in epoch milliseconds


def make_conversation(*, agent: str = "assistant", **fields: Any) -> Conversation:
    return Conversation.objects.create(agent=agent, name=f"ops-{uuid.uuid4().hex[:10]}", **fields)


def make_fiber(conversation: Conversation, status: str, **fields: Any) -> Fiber:
    """A fiber in `status`; a running one has a lease that expires `lease_in` from now (default: live)."""
    lease_in: timedelta = fields.pop("lease_in", timedelta(hours=1))
    if status in (Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED):
        fields.setdefault("lease_expires_at", timezone.now() + lease_in)
        fields.setdefault("lease_owner", "worker-1")
        fields.setdefault("fencing", 3)
    fields.setdefault("request_id", f"req-{uuid.uuid4().hex[:8]}")
    return Fiber.objects.create(conversation=conversation, status=status, **fields)


def make_incident(conversation: Conversation, status: str, **fields: Any) -> Incident:
    """An incident with the (already recovered) fiber of the turn it is about."""
    request_id = fields.pop("request_id", f"req-{uuid.uuid4().hex[:8]}")
    make_fiber(conversation, Fiber.Status.RECOVERED, request_id=request_id)
    values: dict[str, Any] = {
        "incident_id": f"{request_id}:u-1",
        "request_id": request_id,
        "recovery_root_request_id": request_id,
        "recovery_kind": "continue",
        "attempt": 2,
        "max_attempts": 6,
        "status": status,
        "first_seen_at": T0,
        "last_attempt_at": T0 + 5_000,
        **fields,
    }
    return Incident.objects.create(conversation=conversation, **values)


def recovery_alarm(conversation: Conversation, incident: Incident, callback: str) -> Alarm:
    """The pending alarm that would start the incident's continuation or retry."""
    return Alarm.objects.create(
        conversation=conversation,
        callback=callback,
        payload={"incidentId": incident.incident_id, "originalRequestId": incident.request_id},
        due_at=timezone.now() + timedelta(seconds=30),
    )


def add_user_message(conversation: Conversation, text: str = "hello") -> Message:
    position = Message.objects.filter(conversation=conversation).count()
    return Message.objects.create(
        conversation=conversation,
        message_id=f"u-{uuid.uuid4().hex[:8]}",
        role="user",
        parts=[{"type": "text", "text": text}],
        position=position,
    )


class Delays:
    """Stands in for `dispatch.recover_later`: records the ids, sends nothing to a broker."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, fiber_id: str) -> None:
        self.calls.append(fiber_id)


@pytest.fixture
def delays(monkeypatch: pytest.MonkeyPatch) -> Delays:
    from recovery.process import dispatch

    recorded = Delays()
    monkeypatch.setattr(dispatch, "recover_later", recorded)
    return recorded


class GroupListener:
    """A channel in a conversation's group, to see the frames an operation broadcast.

    It lives on an event loop of its own (the pub/sub channel layer keeps its subscriptions per loop).
    """

    def __init__(self, conversation_id: int) -> None:
        self.received: queue.Queue[dict[str, Any]] = queue.Queue()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        subscribed = asyncio.run_coroutine_threadsafe(self._listen(group_name(conversation_id)), self.loop)
        subscribed.result(10)

    async def _listen(self, group: str) -> None:
        layer = get_channel_layer()
        assert layer is not None
        channel = await layer.new_channel()
        await layer.group_add(group, channel)
        await layer.send(channel, {"type": "ready"})  # once it comes back, the subscriptions are live
        assert (await asyncio.wait_for(layer.receive(channel), 10))["type"] == "ready"

        async def receive() -> None:
            while True:
                self.received.put(await layer.receive(channel))

        self.task = asyncio.ensure_future(receive())

    def events(self, timeout: float = 0.5) -> list[dict[str, Any]]:
        """Every group event received until nothing more arrives within `timeout`."""
        events: list[dict[str, Any]] = []
        while True:
            try:
                events.append(self.received.get(timeout=timeout))
            except queue.Empty:
                return events

    def frames(self, timeout: float = 0.5) -> list[dict[str, Any]]:
        """The broadcast frames among the events."""
        return [json.loads(event["frame"]) for event in self.events(timeout) if "frame" in event]


def terminate_new_backends(django_db_blocker: Any) -> Iterator[None]:
    """End the connections the process loop's DB threads opened meanwhile, so the test database can be
    dropped at the end of the run (the same cleanup as tests/recovery/test_engine_store.py)."""

    def backends() -> set[int]:
        with django_db_blocker.unblock(), connection.cursor() as cursor:
            cursor.execute("SELECT current_database()")
            assert cursor.fetchone()[0].startswith("test_"), "only ever on a test database"
            cursor.execute(
                "SELECT pid FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return {pid for (pid,) in cursor.fetchall()}

    before = backends()
    yield
    leftover = backends() - before
    if leftover:
        with django_db_blocker.unblock(), connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", [sorted(leftover)]
            )
