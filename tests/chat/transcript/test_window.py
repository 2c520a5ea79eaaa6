"""The transcript window (chat.transcript.window): what a client of a long conversation is sent, paging
back, a message too big for any window, and a chat request from a client that holds only the window."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from chat.checks import check_think_settings
from chat.models import Compaction, Conversation, Message
from chat.protocol import ChatRequest
from chat.transcript.selectors import messages_list
from chat.transcript.turns import turn_accept
from chat.transcript.window import TRUNCATED_KEY, message_bytes, transcript_window
from recovery.models import Fiber
from tests.support import TEST_PRINCIPAL, auth_headers

pytestmark = pytest.mark.django_db

BUDGET = 20_000


def text_message(i: int, text: str | None = None) -> dict[str, Any]:
    role = "user" if i % 2 == 0 else "assistant"
    return {"id": f"h{i}", "role": role, "parts": [{"type": "text", "text": text or f"m{i}: " + "x" * 150}]}


@pytest.fixture
def conversation() -> Conversation:
    return Conversation.objects.create(agent="assistant", name="long", owner=TEST_PRINCIPAL)


def grow(conversation: Conversation, count: int, start: int = 0) -> None:
    Message.objects.bulk_create(
        Message(conversation=conversation, message_id=m["id"], role=m["role"], parts=m["parts"], position=i)
        for i, m in ((i, text_message(i)) for i in range(start, start + count))
    )


def ids(messages: list[dict[str, Any]]) -> list[str]:
    return [m["id"] for m in messages]


def test_the_window_is_the_newest_whole_messages_within_the_budget(conversation: Conversation) -> None:
    grow(conversation, 1000)
    window = transcript_window(conversation_id=conversation.pk, budget=BUDGET)
    size = sum(message_bytes(m) for m in window.messages)
    assert size <= BUDGET and size + message_bytes(text_message(0)) > BUDGET, "as many as fit"
    assert window.earlier is True
    assert ids(window.messages) == [f"h{i}" for i in range(1000 - len(window.messages), 1000)]
    assert window.messages[-1] == text_message(999), "whole, as stored"


def test_paging_back_gives_every_message_once_in_order(conversation: Conversation) -> None:
    grow(conversation, 1000)
    window = transcript_window(conversation_id=conversation.pk, budget=BUDGET)
    pages = [window.messages]
    while window.earlier:
        window = transcript_window(
            conversation_id=conversation.pk, before=pages[0][0]["id"], limit=150, budget=BUDGET
        )
        assert 0 < len(window.messages) <= 150
        pages.insert(0, window.messages)
    assert [m for page in pages for m in page] == messages_list(conversation_id=conversation.pk)


def test_a_short_conversation_is_whole(conversation: Conversation) -> None:
    grow(conversation, 10)
    window = transcript_window(conversation_id=conversation.pk)
    assert window.earlier is False and window.messages == messages_list(conversation_id=conversation.pk)
    assert transcript_window(conversation_id=conversation.pk, before="nope").messages == []


def test_a_summary_stands_for_its_range_in_windows_and_pages(conversation: Conversation) -> None:
    grow(conversation, 1000)
    Compaction.objects.create(
        conversation=conversation, compaction_id="c1", from_message_id="h1", to_message_id="h900", summary="S"
    )
    shown = messages_list(conversation_id=conversation.pk)
    assert ids(shown) == ["h0", "compaction_c1", *(f"h{i}" for i in range(901, 1000))]
    window = transcript_window(conversation_id=conversation.pk, budget=BUDGET)
    pages = [window.messages]
    while window.earlier:
        window = transcript_window(conversation_id=conversation.pk, before=pages[0][0]["id"], budget=BUDGET)
        pages.insert(0, window.messages)
    assert [m for page in pages for m in page] == shown


def test_a_message_bigger_than_any_window_is_cut_for_display_only(conversation: Conversation) -> None:
    grow(conversation, 4)
    huge = {"id": "big", "role": "assistant", "parts": [{"type": "text", "text": 'é"' * 40_000}]}
    Message.objects.create(
        conversation=conversation, message_id="big", role="assistant", parts=huge["parts"], position=4
    )
    window = transcript_window(conversation_id=conversation.pk, budget=BUDGET)
    assert ids(window.messages)[-1] == "big"
    assert sum(message_bytes(m) for m in window.messages) <= BUDGET
    shown = window.messages[-1]
    assert shown["metadata"][TRUNCATED_KEY] == {"bytes": message_bytes(huge)}
    assert shown["parts"][0]["text"] and huge["parts"][0]["text"].startswith(shown["parts"][0]["text"])
    assert "cut short" in shown["parts"][-1]["text"]
    assert Message.objects.get(message_id="big").parts == huge["parts"], "stored whole"
    # The client echoes the cut copy: the stored message stays whole, and the new one is appended.
    request = ChatRequest(
        "r1",
        [shown, {"id": "u5", "role": "user", "parts": [{"type": "text", "text": "hi"}]}],
        "submit-message",
    )
    assert not turn_accept(conversation_id=conversation.pk, request=request).refused
    assert Message.objects.get(message_id="big").parts == huge["parts"]
    assert ids(messages_list(conversation_id=conversation.pk))[-2:] == ["big", "u5"]


def test_a_client_holding_only_the_window_continues_and_regenerates(conversation: Conversation) -> None:
    grow(conversation, 1000)
    window = transcript_window(conversation_id=conversation.pk, budget=BUDGET).messages
    new = {"id": "u-new", "role": "user", "parts": [{"type": "text", "text": "and now?"}]}
    accepted = turn_accept(
        conversation_id=conversation.pk, request=ChatRequest("r1", [*window, new], "submit-message")
    )
    assert not accepted.refused
    stored = messages_list(conversation_id=conversation.pk)
    assert len(stored) == 1001 and stored[-1] == new and ids(stored[:1000]) == [f"h{i}" for i in range(1000)]
    Fiber.objects.filter(pk=accepted.fiber_id).update(status=Fiber.Status.COMPLETED)  # that turn ran
    # Regenerate the last answer (h999) from the window: the client drops it and sends the rest.
    regenerate = ChatRequest("r2", [m for m in window if m["id"] != "h999"], "regenerate-message")
    accepted = turn_accept(conversation_id=conversation.pk, request=regenerate)
    assert not accepted.refused
    assert ids(messages_list(conversation_id=conversation.pk)) == [f"h{i}" for i in range(999)]


def test_get_messages_serves_the_window_and_pages(conversation: Conversation, settings: Any) -> None:
    settings.THINK = {**settings.THINK, "TRANSCRIPT_WINDOW_BYTES": BUDGET}
    grow(conversation, 1000)
    client = Client(headers=auth_headers())
    response = client.get("/agents/assistant/long/get-messages")
    assert response.status_code == 200 and response["Think-Earlier"] == "true"
    newest = json.loads(response.content)
    assert newest == transcript_window(conversation_id=conversation.pk).messages
    first = newest[0]["id"]
    page = client.get(f"/agents/assistant/long/get-messages?before={first}&limit=5")
    assert json.loads(page.content) == [text_message(i) for i in range(int(first[1:]) - 5, int(first[1:]))]
    assert page["Think-Earlier"] == "true"
    start = client.get("/agents/assistant/long/get-messages?before=h3")
    assert ids(json.loads(start.content)) == ["h0", "h1", "h2"] and start["Think-Earlier"] == "false"
    assert client.get("/agents/assistant/long/get-messages?limit=0").status_code == 400


@pytest.mark.parametrize(
    ("think", "found"),
    [
        ({"TRANSCRIPT_WINDOW_BYTES": 0}, ["think_chat.E025"]),
        ({"TRANSCRIPT_WINDOW_BYTES": 2_000_000}, ["think_chat.E025"]),
        ({"TRANSCRIPT_WINDOW_BYTES": "big"}, ["think_chat.E025"]),
        ({"TRANSCRIPT_WINDOW_BYTES": 600_000}, ["think_chat.W025"]),
        ({"TRANSCRIPT_WINDOW_BYTES": 256_000}, []),
    ],
)
def test_the_window_setting_is_checked(settings: Any, think: dict[str, Any], found: list[str]) -> None:
    settings.THINK = {**settings.THINK, **think}
    assert [message.id for message in check_think_settings()] == found
