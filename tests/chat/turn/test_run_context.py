"""RunContext (chat.turn.context): what a turn knows of itself, read once as it starts."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth import get_user_model

from chat.models import Conversation
from chat.turn.context import RunContext, run_context_load
from chat.turn.registry import agent_for
from recovery.models import Incident

pytestmark = pytest.mark.django_db


def load(owner: str, incident_id: str | None = None, make_incident: int | None = None) -> RunContext:
    conversation = Conversation.objects.create(
        agent="assistant", name=f"rc-{uuid.uuid4().hex[:8]}", owner=owner
    )
    if make_incident is not None:
        Incident.objects.create(
            conversation=conversation,
            incident_id="inc-1",
            request_id="r-0",
            recovery_root_request_id="r-0",
            recovery_kind="continue",
            attempt=make_incident,
            max_attempts=5,
            status=Incident.Status.RUNNING,
            first_seen_at=0,
            last_attempt_at=0,
        )
    agent = agent_for("assistant", conversation.name, conversation.pk)
    return run_context_load(
        agent=agent, conversation_id=conversation.pk, request_id="r-1", incident_id=incident_id
    )


def test_a_users_conversation_carries_the_user() -> None:
    user = get_user_model().objects.create_user("ada", password="x")

    context = load(f"user:{user.pk}")

    assert context.user == user and context.owner == f"user:{user.pk}"
    assert context.conversation.owner == context.owner
    assert context.agent.name == context.conversation.name
    assert (context.request_id, context.attempt, context.recovering) == ("r-1", 0, False)
    assert context.tool_call_id is None and context.for_call("c-1").tool_call_id == "c-1"


@pytest.mark.parametrize(
    "owner", ["", "session:abc123", "user:999999999", "user:not-a-number", "test:client"]
)
def test_anyone_else_has_no_user(owner: str) -> None:
    context = load(owner)

    assert context.user is None and context.owner == owner


def test_a_recovery_run_knows_its_attempt() -> None:
    context = load("test:client", incident_id="inc-1", make_incident=3)

    assert context.attempt == 3 and context.recovering
