"""The read-only admin: pages render (the transcript readable and escaped), nothing can be edited, and the
operator actions work end to end through the changelist."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from chat.models import Branch, Compaction, Conversation, Message, Submission, TurnCompletion
from recovery.budget.incidents import DEFAULT_TERMINAL_MESSAGE
from recovery.models import Fiber, Incident, Segment, Stream
from tests.operator_support import (
    T0,
    Delays,
    delays,
    make_conversation,
    make_fiber,
    make_incident,
    terminate_new_backends,
)

__all__ = ["delays"]  # a fixture used by name

pytestmark = pytest.mark.django_db

USER_TEXT = "<script>alert('x')</script> & is it <b>sunny</b>?"
REASONING = "Think <i>first</i> & then answer"
TOOL_INPUT = {"city": "<Paris>"}
TOOL_OUTPUT = {"celsius": 21, "note": "a < b & c"}
DENY_REASON = "<not today>"
SUMMARY = "Summary of <2> lines & more"
COMPACTED_TEXT = "an early question nobody should see"


@pytest.fixture(scope="module", autouse=True)
def close_db_thread_connections(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    yield from terminate_new_backends(django_db_blocker)


@pytest.fixture
def admin_client(client: Client) -> Client:
    user = User.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(user)
    return client


def add(conversation: Conversation, message_id: str, role: str, parts: list[dict[str, Any]]) -> Message:
    position = Message.objects.filter(conversation=conversation).count()
    return Message.objects.create(
        conversation=conversation, message_id=message_id, role=role, parts=parts, position=position
    )


@pytest.fixture
def conversation() -> Conversation:
    """A transcript with every kind of part, and a compaction over its first two messages."""
    conversation = make_conversation()
    add(conversation, "u-old", "user", [{"type": "text", "text": COMPACTED_TEXT}])
    add(conversation, "a-old", "assistant", [{"type": "text", "text": "an early answer"}])
    Compaction.objects.create(
        conversation=conversation,
        compaction_id="c1",
        from_message_id="u-old",
        to_message_id="a-old",
        summary=SUMMARY,
    )
    add(conversation, "u-1", "user", [{"type": "text", "text": USER_TEXT}])
    weather = {
        "type": "tool-get_weather",
        "toolCallId": "call-weather",
        "state": "output-available",
        "input": TOOL_INPUT,
        "output": TOOL_OUTPUT,
    }
    add(
        conversation,
        "a-1",
        "assistant",
        [
            {"type": "step-start"},
            {"type": "reasoning", "text": REASONING},
            weather,
            {"type": "text", "text": "Sunny."},
        ],
    )
    asking = {
        "type": "tool-send_email",
        "toolCallId": "call-email",
        "state": "approval-requested",
        "input": {"to": "a@b.c"},
        "approval": {"id": "approval-email"},
    }
    denied = {
        "type": "dynamic-tool",
        "toolName": "refund",
        "toolCallId": "call-refund",
        "state": "output-denied",
        "input": {"order": "o-1"},
        "approval": {"id": "approval-refund", "approved": False, "reason": DENY_REASON},
    }
    add(conversation, "a-2", "assistant", [asking, denied])
    return conversation


def page(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return response.content.decode()


def test_the_conversation_page_renders_the_visible_transcript_escaped(
    admin_client: Client, conversation: Conversation
) -> None:
    html = page(admin_client, reverse("admin:think_chat_conversation_change", args=[conversation.pk]))
    for text in (USER_TEXT, REASONING, SUMMARY, DENY_REASON, "Sunny."):
        assert escape(text) in html, text
    for raw in ("<script>alert", "<b>sunny</b>", "<i>first</i>", "<Paris>", "<not today>", "<2>"):
        assert raw not in html, f"{raw} must be escaped"
    # The input and output as indented JSON (jsonb keeps its own key order).
    assert escape(json.dumps(TOOL_INPUT, indent=2)) in html
    for key, value in TOOL_OUTPUT.items():
        assert escape(f"  {json.dumps(key)}: {json.dumps(value)}") in html
    assert "tool get_weather</strong> <code>call-weather</code> [output-available]" in html
    assert "approval: <strong>requested</strong> <code>approval-email</code>" in html
    assert "tool refund</strong> <code>call-refund</code> [output-denied]" in html
    assert "approval: <strong>denied</strong> <code>approval-refund</code>" in html
    assert "compaction summary <small><code>compaction_c1</code>" in html
    assert "<em>reasoning</em>" in html
    assert COMPACTED_TEXT not in html, "the compacted messages show as their summary"
    assert reverse("admin:think_chat_message_change", args=[Message.objects.get(message_id="a-2").pk]) in html
    assert 'name="_save"' not in html, "nothing is editable"


def test_every_changelist_and_change_page_renders(admin_client: Client, conversation: Conversation) -> None:
    fiber = make_fiber(conversation, Fiber.Status.RUNNING, interruption="stalled")
    stream = Stream.objects.create(conversation=conversation, fiber=fiber, request_id="r", message_id="m")
    for seq in range(3):
        Segment.objects.create(stream=stream, seq_start=seq, seq_end=seq, body="{}", fencing=1)
    incident = make_incident(conversation, Incident.Status.EXHAUSTED, reason="no_progress_timeout")
    submission = Submission.objects.create(conversation=conversation, submission_id="s-1", request_id="s-1")
    message = Message.objects.get(message_id="a-1")
    branch = Branch.objects.create(
        conversation=conversation,
        anchor_message_id="u-1",
        messages=[{"id": "a-0", "role": "assistant", "parts": [{"type": "text", "text": "<older> answer"}]}],
        first_created_at=timezone.now(),
    )
    completion = TurnCompletion.objects.create(
        conversation=conversation, request_id="r-1", last_request_id="r-1", ending="completed"
    )
    rows = {
        "think_chat_branch": branch,
        "think_chat_turncompletion": completion,
        "think_chat_conversation": conversation,
        "think_chat_message": message,
        "think_chat_submission": submission,
        "think_recovery_fiber": fiber,
        "think_recovery_stream": stream,
        "think_recovery_incident": incident,
    }
    for name, row in rows.items():
        page(admin_client, reverse(f"admin:{name}_changelist"))
        html = page(admin_client, reverse(f"admin:{name}_change", args=[row.pk]))
        assert 'name="_save"' not in html, name
    assert escape(REASONING) in page(
        admin_client, reverse("admin:think_chat_message_change", args=[message.pk])
    )
    assert escape("<older> answer") in page(
        admin_client, reverse("admin:think_chat_branch_change", args=[branch.pk])
    )
    assert '<td class="field-segment_count">3</td>' in page(
        admin_client, reverse("admin:think_recovery_stream_changelist")
    )
    incidents = page(admin_client, reverse("admin:think_recovery_incident_changelist"))
    assert '<td class="field-attempts">2 / 6</td>' in incidents
    assert "Nov. 14, 2023, 10:13 p.m." in incidents, "epoch milliseconds show as datetimes"
    assert str(T0) not in incidents
    fibers = page(admin_client, reverse("admin:think_recovery_fiber_changelist"))
    assert '<td class="field-fencing">3</td>' in fibers and "worker-1" in fibers and "stalled" in fibers


@pytest.mark.parametrize(
    "model", ["think_chat_conversation", "think_recovery_fiber", "think_recovery_incident"]
)
def test_nothing_can_be_added_changed_or_deleted(admin_client: Client, model: str) -> None:
    conversation = make_conversation()
    row = {
        "think_chat_conversation": conversation,
        "think_recovery_fiber": make_fiber(conversation, Fiber.Status.RUNNING),
        "think_recovery_incident": make_incident(conversation, Incident.Status.SCHEDULED),
    }[model]
    assert admin_client.get(reverse(f"admin:{model}_add")).status_code == 403
    assert admin_client.post(reverse(f"admin:{model}_change", args=[row.pk]), {}).status_code == 403
    assert admin_client.get(reverse(f"admin:{model}_delete", args=[row.pk])).status_code == 403
    assert "delete_selected" not in page(admin_client, reverse(f"admin:{model}_changelist"))


def post_action(client: Client, model: str, action: str, pks: list[Any]) -> str:
    response = client.post(
        reverse(f"admin:{model}_changelist"),
        {"action": action, "_selected_action": [str(pk) for pk in pks], "index": "0"},
        follow=True,
    )
    assert response.status_code == 200
    return response.content.decode()


def test_force_recovery_of_fibers_from_the_changelist(
    admin_client: Client, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    conversation = make_conversation()
    running = make_fiber(conversation, Fiber.Status.RUNNING)
    finished = make_fiber(conversation, Fiber.Status.COMPLETED)
    with django_capture_on_commit_callbacks(execute=True):
        html = post_action(admin_client, "think_recovery_fiber", "force_recover", [running.pk, finished.pk])
    assert "1 fiber(s) handed to recovery." in html
    assert "is completed: only a running or interrupted fiber can be recovered" in html
    assert delays.calls == [str(running.pk)]
    assert Fiber.objects.get(pk=running.pk).status == Fiber.Status.INTERRUPTED
    assert Fiber.objects.get(pk=finished.pk).status == Fiber.Status.COMPLETED


def test_force_recovery_of_conversations_from_the_changelist(
    admin_client: Client, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    conversation = make_conversation()
    fibers = [make_fiber(conversation, status) for status in (Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED)]
    with django_capture_on_commit_callbacks(execute=True):
        html = post_action(admin_client, "think_chat_conversation", "force_recover", [conversation.pk])
    assert "2 fiber(s) handed to recovery." in html
    assert sorted(delays.calls) == sorted(str(f.pk) for f in fibers)
    assert {Fiber.objects.get(pk=f.pk).interruption for f in fibers} == {"forced"}


def test_clear_the_recovering_flag_from_the_changelist(admin_client: Client) -> None:
    flagged = make_conversation(recovering={"requestId": "r-1", "at": 1})
    html = post_action(admin_client, "think_chat_conversation", "clear_recovering", [flagged.pk])
    assert "Cleared the recovering flag of 1 conversation(s)." in html
    flagged.refresh_from_db()
    assert flagged.recovering is None


@pytest.mark.django_db(transaction=True)
def test_give_up_from_the_incident_and_conversation_changelists(admin_client: Client) -> None:
    by_incident = make_incident(make_conversation(), Incident.Status.SCHEDULED)
    html = post_action(admin_client, "think_recovery_incident", "give_up", [by_incident.pk])
    assert "Gave up on 1 incident(s); the terminal message was sent." in html
    conversation = make_conversation()
    by_conversation = make_incident(conversation, Incident.Status.ATTEMPTING)
    html = post_action(admin_client, "think_chat_conversation", "give_up", [conversation.pk])
    assert "Gave up on 1 open incident(s); the terminal message was sent." in html
    for incident in (by_incident, by_conversation):
        incident.refresh_from_db()
        assert (incident.status, incident.reason) == (Incident.Status.EXHAUSTED, "forced")
        terminal = Conversation.objects.get(pk=incident.conversation_id).last_terminal
        assert terminal == {"requestId": incident.request_id, "body": DEFAULT_TERMINAL_MESSAGE}


@pytest.mark.django_db(transaction=True)
def test_stop_everything_from_the_conversation_changelist(admin_client: Client) -> None:
    conversation = make_conversation()
    queued = make_fiber(conversation, Fiber.Status.PENDING)
    incident = make_incident(conversation, Incident.Status.SCHEDULED)
    html = post_action(admin_client, "think_chat_conversation", "stop_everything", [conversation.pk])
    assert "Stopped 1 conversation(s): 1 turn(s), 0 waiting tool call(s), 1 open incident(s)." in html
    assert Fiber.objects.get(pk=queued.pk).status == Fiber.Status.CANCELLED
    incident.refresh_from_db()
    assert (incident.status, incident.reason) == ("cancelled", "stopped")


def test_spend_shows_per_conversation_turn_and_incident(admin_client: Client) -> None:
    conversation = make_conversation()
    for tokens, cost in ((100, "0.25"), (23, None)):
        fiber = make_fiber(conversation, Fiber.Status.COMPLETED)
        Fiber.objects.filter(pk=fiber.pk).update(input_tokens=tokens - 3, output_tokens=3, cost=cost)
    make_incident(conversation, Incident.Status.EXHAUSTED, reason="cost_budget_exceeded", spent_tokens=77)
    conversations = page(admin_client, reverse("admin:think_chat_conversation_changelist"))
    assert '<td class="field-tokens">123</td>' in conversations
    assert '<td class="field-cost">0.250000000000</td>' in conversations
    fibers = page(admin_client, reverse("admin:think_recovery_fiber_changelist"))
    assert '<td class="field-input_tokens">97</td>' in fibers
    incidents = page(admin_client, reverse("admin:think_recovery_incident_changelist"))
    assert '<td class="field-spent_tokens">77</td>' in incidents


def staff(client: Client, *codenames: str) -> Client:
    user = User.objects.create_user("staff", "staff@example.com", "pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client.force_login(user)
    return client


def test_staff_with_only_the_view_permission_can_read_but_not_run_actions(
    client: Client, django_capture_on_commit_callbacks: Any, delays: Delays
) -> None:
    fiber = make_fiber(make_conversation(), Fiber.Status.RUNNING)
    viewer = staff(client, "view_fiber")
    assert "force_recover" not in page(viewer, reverse("admin:think_recovery_fiber_changelist"))
    with django_capture_on_commit_callbacks(execute=True):
        post_action(viewer, "think_recovery_fiber", "force_recover", [fiber.pk])
    assert (Fiber.objects.get(pk=fiber.pk).status, delays.calls) == (Fiber.Status.RUNNING, [])


def test_staff_with_the_change_permission_can_run_actions(
    client: Client, django_capture_on_commit_callbacks: Any, delays: Delays
) -> None:
    fiber = make_fiber(make_conversation(), Fiber.Status.RUNNING)
    operator = staff(client, "change_fiber")
    assert "force_recover" in page(operator, reverse("admin:think_recovery_fiber_changelist"))
    with django_capture_on_commit_callbacks(execute=True):
        post_action(operator, "think_recovery_fiber", "force_recover", [fiber.pk])
    assert (Fiber.objects.get(pk=fiber.pk).status, delays.calls) == (
        Fiber.Status.INTERRUPTED,
        [str(fiber.pk)],
    )


def test_a_user_who_is_not_staff_is_sent_to_the_login_page(client: Client) -> None:
    client.force_login(User.objects.create_user("visitor", "v@example.com", "pw"))
    url = reverse("admin:think_chat_conversation_changelist")
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"] == f"{reverse('admin:login')}?next={url}"


def waiting_call(call_id: str) -> dict[str, Any]:
    return {
        "type": "tool-delete_file",
        "toolCallId": call_id,
        "state": "approval-requested",
        "input": {"tag": call_id},
        "approval": {"id": f"approval-{call_id}"},
    }


def test_approve_and_deny_the_waiting_tool_calls_from_the_conversation_changelist(
    admin_client: Client,
) -> None:
    """Issue 36: the admin decides through AgentHandle.approve / deny, the path of a client's approval:
    once every call of the step has its answer, the continuation is queued."""
    approve_me, deny_me = make_conversation(agent="tool-agent"), make_conversation(agent="tool-agent")
    for conversation, calls in ((approve_me, ["c-1", "c-2"]), (deny_me, ["c-3"])):
        add(conversation, "u1", "user", [{"type": "text", "text": "go"}])
        add(conversation, "a1", "assistant", [waiting_call(c) for c in calls])

    html = post_action(admin_client, "think_chat_conversation", "approve_waiting", [approve_me.pk])
    assert "Approved 2 tool call(s)." in html
    parts = Message.objects.get(conversation=approve_me, message_id="a1").parts
    assert [(p["state"], p["approval"]["approved"]) for p in parts] == [("approval-responded", True)] * 2
    assert Fiber.objects.filter(conversation=approve_me, status=Fiber.Status.PENDING).count() == 1

    html = post_action(admin_client, "think_chat_conversation", "deny_waiting", [deny_me.pk])
    assert "Denied 1 tool call(s)." in html
    [part] = Message.objects.get(conversation=deny_me, message_id="a1").parts
    assert part["state"] == "output-denied"
    assert part["approval"] == {
        "id": "approval-c-3",
        "approved": False,
        "reason": "denied by an operator",
    }

    html = post_action(
        admin_client, "think_chat_conversation", "approve_waiting", [approve_me.pk, deny_me.pk]
    )
    assert "Approved 0 tool call(s)." in html, "nothing waits any more"


def test_deciding_waiting_tool_calls_needs_the_operate_permission(client: Client) -> None:
    conversation = make_conversation(agent="tool-agent")
    add(conversation, "a1", "assistant", [waiting_call("c-9")])
    viewer = staff(client, "view_conversation")
    assert "approve_waiting" not in page(viewer, reverse("admin:think_chat_conversation_changelist"))
    post_action(viewer, "think_chat_conversation", "approve_waiting", [conversation.pk])
    [part] = Message.objects.get(conversation=conversation, message_id="a1").parts
    assert part["state"] == "approval-requested"
