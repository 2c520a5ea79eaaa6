"""Durable submissions against a real worker and Postgres."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from chat.agents import Think, open_agent
from chat.models import Submission
from chat.transcript.snapshot import FiberSnapshot
from chat.transcript.submissions import (
    INTERRUPTED_TEXT,
    SKIPPED_TEXT,
    SubmissionConflict,
    SubmissionNotFound,
    submissions_sweep,
)
from recovery.models import Fiber, Segment
from tests.support import TEST_PRINCIPAL, ChatClient, chat_request, numbers, user_message, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def new_agent() -> Think:
    return open_agent("assistant", f"s-{uuid.uuid4().hex[:10]}", owner=TEST_PRINCIPAL)


def status_of(agent: Think, submission_id: str) -> str:
    return agent.get_submission(submission_id).status


def wait_status(agent: Think, submission_id: str, *statuses: str, timeout: float = 30) -> Submission:
    wait_until(lambda: status_of(agent, submission_id) in statuses, timeout, f"submission {statuses}")
    return agent.get_submission(submission_id)


def settle(agent: Think) -> None:
    """Let the worker finish what a test left (a flush of the test database must not race a turn)."""

    def idle() -> bool:
        open_rows = Submission.objects.filter(conversation_id=agent.conversation_id).open()
        busy = Fiber.objects.filter(conversation_id=agent.conversation_id).active()
        return not open_rows.exists() and not busy.exists()

    wait_until(idle, 30, "the conversation to settle")


def user_texts(agent: Think) -> list[str]:
    return [m["parts"][0]["text"] for m in agent.messages() if m["role"] == "user"]


@pytest.mark.usefixtures("stack")
def test_a_submission_is_accepted_then_drained_and_completed(transactional_db: Any) -> None:
    agent = new_agent()
    result = agent.submit_messages(["count to 3"], metadata={"source": "cron"})
    assert result.accepted and result.status == "pending" and result.request_id == result.submission_id
    row = wait_status(agent, result.submission_id, "completed")
    assert row.metadata == {"source": "cron"} and row.error == ""
    assert row.started_at is not None and row.messages_applied_at is not None and row.finished_at is not None
    assert [m["role"] for m in agent.messages()] == ["user", "assistant"]
    fiber = Fiber.objects.get(request_id=result.request_id)
    assert FiberSnapshot.from_json(fiber.snapshot).turn.submission_id == result.submission_id


@pytest.mark.usefixtures("stack")
def test_idempotency_by_key_and_by_id(transactional_db: Any) -> None:
    agent = new_agent()
    first = agent.submit_messages(["count to 2"], idempotency_key="k-1")
    again = agent.submit_messages(["something else"], idempotency_key="k-1")
    assert not again.accepted and again.submission_id == first.submission_id
    by_id = agent.submit_messages(["count to 2"], submission_id="sub-fixed")
    assert by_id.accepted and by_id.submission_id == "sub-fixed"
    assert not agent.submit_messages(["x"], submission_id="sub-fixed").accepted
    wait_status(agent, "sub-fixed", "completed")
    assert user_texts(agent) == ["count to 2", "count to 2"], "each submission ran once"


@pytest.mark.usefixtures("stack")
def test_concurrent_calls_with_one_key_make_one_submission(transactional_db: Any) -> None:
    agent = new_agent()

    def submit(_: int) -> str:
        from django.db import connection

        try:
            return (
                open_agent("assistant", agent.name)
                .submit_messages(["count to 1"], idempotency_key="same")
                .submission_id
            )
        finally:
            connection.close()

    with ThreadPoolExecutor(6) as pool:
        ids = set(pool.map(submit, range(6)))
    assert len(ids) == 1
    assert Submission.objects.filter(conversation_id=agent.conversation_id).count() == 1
    settle(agent)


@pytest.mark.usefixtures("stack")
def test_conflicts_and_bad_input_are_refused(transactional_db: Any) -> None:
    agent = new_agent()
    agent.submit_messages(["a"], submission_id="one", idempotency_key="key-one")
    agent.submit_messages(["b"], submission_id="two", idempotency_key="key-two")
    with pytest.raises(SubmissionConflict):
        agent.submit_messages(["c"], submission_id="one", idempotency_key="key-two")
    with pytest.raises(ValueError, match="non-empty"):
        agent.submit_messages([])
    with pytest.raises(ValueError, match="idempotency_key"):
        agent.submit_messages(["a"], idempotency_key="")
    with pytest.raises(SubmissionNotFound):
        agent.cancel_submission("nobody")
    assert Submission.objects.filter(conversation_id=agent.conversation_id).count() == 2
    settle(agent)


@pytest.mark.usefixtures("stack")
def test_submissions_run_first_in_first_out(transactional_db: Any) -> None:
    agent = new_agent()
    ids = [agent.submit_messages([f"count to {n}"]).submission_id for n in (1, 2, 3)]
    for sid in ids:
        wait_status(agent, sid, "completed")
    assert user_texts(agent) == ["count to 1", "count to 2", "count to 3"]
    assistant = [m for m in agent.messages() if m["role"] == "assistant"]
    assert [m["parts"][-1]["text"] for m in assistant] == [numbers(1), numbers(2), numbers(3)]


async def test_a_pending_submission_waits_for_a_running_turn_and_can_be_cancelled(stack: Any) -> None:
    agent = await sync_to_async(new_agent)()
    async with ChatClient(stack.port, agent.name) as client:
        await client.send(chat_request("busy-1", [user_message("count to 40 [rate 40]")]))
        await client.recv_type("cf_agent_use_chat_response")
        queued = await sync_to_async(agent.submit_messages)(["count to 2"])
        cancelled = await sync_to_async(agent.submit_messages)(["never run"])
        assert await sync_to_async(status_of)(agent, queued.submission_id) == "pending"
        assert await sync_to_async(agent.cancel_submission)(cancelled.submission_id)
        await client.follow("busy-1", timeout=30)
    await sync_to_async(wait_status)(agent, queued.submission_id, "completed")
    row = await sync_to_async(agent.get_submission)(cancelled.submission_id)
    assert row.status == "aborted"
    assert "never run" not in await sync_to_async(user_texts)(agent)
    assert not await sync_to_async(agent.cancel_submission)(cancelled.submission_id), "already ended"


@pytest.mark.usefixtures("stack")
def test_cancelling_a_running_submission_is_not_overwritten_by_its_turn(transactional_db: Any) -> None:
    agent = new_agent()
    result = agent.submit_messages(["count to 200 [rate 20]"])
    wait_status(agent, result.submission_id, "running")
    # A stored word, not only a stored chunk: the first segment may hold `start` chunks alone, and a turn
    # stopped then has no partial to keep (seen once in ten runs).
    wait_until(
        lambda: Segment.objects.filter(
            stream__request_id=result.request_id, body__contains='"text-delta"'
        ).exists(),
        15,
        "a stored word",
    )
    assert agent.cancel_submission(result.submission_id)
    wait_until(
        lambda: Fiber.objects.filter(request_id=result.request_id, status="cancelled").exists(), 15, "stop"
    )
    assert status_of(agent, result.submission_id) == "aborted"
    messages = agent.messages()
    assert messages[-1]["role"] == "assistant", "the cancelled turn keeps its partial"


async def test_a_clear_skips_open_submissions(stack: Any) -> None:
    agent = await sync_to_async(new_agent)()
    async with ChatClient(stack.port, agent.name) as client:
        await client.send(chat_request("busy-2", [user_message("count to 60 [rate 30]")]))
        await client.recv_type("cf_agent_use_chat_response")
        queued = await sync_to_async(agent.submit_messages)(["count to 2"])
        await client.send({"type": "cf_agent_chat_clear"})

        def settled() -> bool:
            """The submission is no longer open and the cleared turn's fiber has reached its end."""
            row = agent.get_submission(queued.submission_id)
            active = Fiber.objects.filter(conversation_id=agent.conversation_id).active().exists()
            return row.status not in ("pending", "running") and not active

        await sync_to_async(wait_until)(settled, 15, "the clear to settle the submission and the turn")
    row = await sync_to_async(agent.get_submission)(queued.submission_id)
    assert (row.status, row.error) == ("skipped", SKIPPED_TEXT)
    assert await sync_to_async(agent.messages)() == []


@pytest.mark.usefixtures("stack")
def test_a_stream_error_is_kept_as_the_submission_error(transactional_db: Any) -> None:
    # An agent with chat_recovery = False: by default a 5xx mid-stream is recovered, not an error.
    agent = open_agent("no-model-recovery-agent", f"s-{uuid.uuid4().hex[:10]}", owner=TEST_PRINCIPAL)
    result = agent.submit_messages(["count to 10 [fail after 3 with 500]"])
    row = wait_status(agent, result.submission_id, "error")
    # What clients were told (the provider's own text is in the Fault row: docs/security.md).
    assert row.error.startswith("The model provider failed (error ")


@pytest.mark.usefixtures("stack")
def test_stale_running_rows_are_requeued_when_not_applied_and_errored_when_applied(
    transactional_db: Any,
) -> None:
    agent = new_agent()
    conversation_id = agent.conversation_id
    message = {"id": "m-na", "role": "user", "parts": [{"type": "text", "text": "count to 1"}]}
    not_applied = Submission.objects.create(
        conversation_id=conversation_id,
        submission_id="na",
        request_id="na",
        status="running",
        messages=[message],
    )
    applied = Submission.objects.create(
        conversation_id=conversation_id,
        submission_id="ap",
        request_id="ap",
        status="running",
        messages=[],
        messages_applied_at=timezone.now(),
    )
    submissions_sweep()
    not_applied.refresh_from_db()
    applied.refresh_from_db()
    assert not_applied.status in ("pending", "running")  # back in the queue (a worker may take it)
    assert (applied.status, applied.error) == ("error", INTERRUPTED_TEXT)
    settle(agent)


@pytest.mark.usefixtures("stack")
def test_delete_and_list_only_delete_finished_submissions(transactional_db: Any) -> None:
    agent = new_agent()
    agent.submit_messages(["a"], submission_id="open")
    Submission.objects.create(
        conversation_id=agent.conversation_id, submission_id="done", request_id="done", status="completed"
    )
    assert {s.submission_id for s in agent.list_submissions()} == {"open", "done"}
    assert not agent.delete_submission("open")
    assert agent.delete_submission("done")
    assert [s.submission_id for s in agent.list_submissions()] == ["open"]
    settle(agent)
