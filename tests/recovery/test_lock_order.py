"""One lock order, conversation before fiber, so a turn's flush and a transaction that locks the
conversation and then its fibers (a clear, a turn's finish) can never deadlock.

Found by the seeded frame fuzz (tests/e2e/test_frame_fuzz.py): a clear sent while a turn streamed
deadlocked with that turn's flush, which had locked its fiber (the lease renewal) and then wanted the
conversation (its progress credit); Postgres broke the cycle after a second by failing the flush.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection, transaction

from chat.transcript.services import conversation_lock
from recovery.lease.fibers import fibers_fence_out
from recovery.models import Fiber, Segment, Stream
from recovery.stream.buffer import SegmentEntry, segments_write
from tests.operator_support import make_conversation, make_fiber

pytestmark = pytest.mark.django_db(transaction=True)


def flush_waits_for_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE %s",
            ["%WITH input AS%"],
        )
        return bool(cursor.fetchone()[0])


def test_a_flush_and_a_clear_of_its_conversation_never_deadlock() -> None:
    conversation = make_conversation()
    fiber = make_fiber(conversation, Fiber.Status.RUNNING)
    stream = Stream.objects.create(
        conversation=conversation,
        fiber=fiber,
        request_id=fiber.request_id,
        message_id="m",
        status=Stream.Status.STREAMING,
    )
    entry = SegmentEntry(fiber.pk, fiber.fencing, stream.pk, ((0, 0, '{"type":"start"}'),), credit=1)
    errors: list[BaseException] = []
    written: dict[str, Any] = {}
    locked, flush_blocked = threading.Event(), threading.Event()

    def clear() -> None:  # conversation_clear's order: the conversation, then its fibers
        try:
            with transaction.atomic():
                conversation_lock(conversation.pk)
                locked.set()
                assert flush_blocked.wait(10), "the flush never waited for the conversation"
                fibers_fence_out(conversation_id=conversation.pk)
        except BaseException as error:
            errors.append(error)
        finally:
            connection.close()

    def flush() -> None:
        locked.wait(10)
        try:
            written.update(segments_write([entry]))
            written["done"] = True
        except BaseException as error:
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=clear), threading.Thread(target=flush)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while not flush_waits_for_a_lock():
        assert time.monotonic() < deadline, "the flush never blocked"
        time.sleep(0.02)
    flush_blocked.set()
    for thread in threads:
        thread.join(20)

    assert errors == [], "a deadlock (or another error) broke one side"
    assert written == {"done": True}, "the flush waited for the clear and then found its fiber fenced out"
    fiber.refresh_from_db()
    assert (fiber.status, fiber.fencing) == (Fiber.Status.CANCELLED, 4)
    assert not Segment.objects.filter(stream=stream).exists()
    conversation.refresh_from_db()
    assert conversation.progress == 0, "no credit for a fenced-out flush"
