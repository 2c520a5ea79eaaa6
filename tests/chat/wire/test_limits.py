"""Limits on client input: their settings and checks, the frame rate, the queue depth and message sizes
at acceptance, and what the consumer answers when one is hit (nothing stored, in every case)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from unittest import mock

import pytest
from channels.db import database_sync_to_async
from django.conf import settings as django_settings
from django.test import override_settings

from chat import protocol as p
from chat.checks import check_think_settings
from chat.conf import frame_limits
from chat.models import Conversation, Message
from chat.protocol import ChatRequest
from chat.transcript.snapshot import TurnKind
from chat.transcript.turns import turn_accept
from chat.wire.limits import TokenBucket, frame_bucket
from recovery.checks import check_recovery_settings
from recovery.lease.fibers import fiber_create
from recovery.models import Fiber
from tests.chat.sockets import chat_response, connected, new_name, probe, seed_conversation, stored_state

LIMIT_KEYS = [
    "MAX_NAME_LENGTH",
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_MESSAGE_PARTS",
    "MAX_TOOL_OUTPUT_BYTES",
    "MAX_QUEUED_TURNS",
    "MAX_FRAME_BURST",
    "MAX_NEW_MESSAGES",
    "MAX_FILE_BYTES",
    "MAX_MESSAGE_FILES",
    "MAX_MODEL_FILE_BYTES",
    "WEB_DB_THREADS",
]


def think(**overrides: Any) -> dict[str, Any]:
    return {**django_settings.THINK, **overrides}


def check_ids() -> list[str]:
    return [message.id or "" for message in check_think_settings()]


# -- settings and system checks ------------------------------------------------------------------------
def test_the_defaults_pass_the_checks_once_a_site_names_its_agents_and_model(settings: Any) -> None:
    settings.THINK = {}
    assert check_ids() == ["think_chat.E001"], "the apps name no agent of their own"
    settings.THINK = {"AGENTS": {"assistant": "thinkproject.agents.Assistant"}}
    assert check_ids() == ["think_chat.E011"], "nor a model"
    settings.THINK = {"AGENTS": {"assistant": "thinkproject.agents.Assistant"}, "MODEL": "openai/gpt-test"}
    assert check_ids() == []
    assert frame_limits() == p.DEFAULT_LIMITS  # the codec's defaults are the settings' defaults


@pytest.mark.parametrize("key", LIMIT_KEYS)
@pytest.mark.parametrize("value", [0, -1, 1.5, "100", None, True])
def test_a_limit_must_be_a_positive_integer(settings: Any, key: str, value: Any) -> None:
    settings.THINK = think(**{key: value})
    [error] = check_think_settings()
    assert error.id == "think_chat.E007"
    assert f"THINK[{key!r}] must be a positive integer" in error.msg


@pytest.mark.parametrize("value", ["image/png", ["image/png", "Image/PNG"], ["png"], [None], None])
def test_file_types_must_be_a_list_of_media_types(settings: Any, value: Any) -> None:
    settings.THINK = think(FILE_TYPES=value)
    assert check_ids() == ["think_chat.E030"]


@pytest.mark.parametrize("value", [0, -2.5, "20", None, False])
def test_the_frame_rate_must_be_a_positive_number(settings: Any, value: Any) -> None:
    settings.THINK = think(MAX_FRAMES_PER_S=value)
    assert check_ids() == ["think_chat.E005"]


def test_a_fractional_frame_rate_is_fine(settings: Any) -> None:
    settings.THINK = think(MAX_FRAMES_PER_S=0.5)
    assert check_ids() == []


def test_a_timing_of_the_wrong_type_is_reported_not_crashed_on(settings: Any) -> None:
    settings.THINK = think(LEASE_TTL_S="3")
    assert [m.id for m in check_recovery_settings()] == ["think_recovery.E001"]


def test_frame_limits_follow_the_settings(settings: Any) -> None:
    settings.THINK = think(
        MAX_FRAME_BYTES=10, MAX_MESSAGE_BYTES=20, MAX_MESSAGE_PARTS=3, MAX_TOOL_OUTPUT_BYTES=40
    )
    assert frame_limits() == p.Limits(10, 20, 3, 40)


# -- the token bucket ------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    clock.now += 0.25  # half a token
    assert not bucket.take()
    clock.now += 0.25
    assert bucket.take() and not bucket.take()
    clock.now += 60  # a long pause refills only up to the burst
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]


def test_a_refused_frame_takes_no_token() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=1.0, burst=1, clock=clock)
    assert bucket.take()
    for _ in range(10):
        assert not bucket.take()
        clock.now += 0.05
    clock.now += 0.55  # 1.05 s since the first frame: the refused ones took nothing
    assert bucket.take()


def test_frame_bucket_reads_the_settings(settings: Any) -> None:
    settings.THINK = think(MAX_FRAMES_PER_S=5, MAX_FRAME_BURST=7)
    bucket = frame_bucket()
    assert (bucket.rate, bucket.burst, bucket.tokens) == (5.0, 7, 7.0)


# -- turn acceptance: queue depth and the messages a request adds ---------------------------------------
def user(message_id: str, text: str = "hi", parts: int = 1) -> dict[str, Any]:
    return {
        "id": message_id,
        "role": "user",
        "parts": [{"type": "text", "text": text}] * parts,
        "metadata": None,
    }


@pytest.fixture
def conversation() -> Conversation:
    return Conversation.objects.create(agent="assistant", name=new_name("limits"))


def accept(
    conversation: Conversation, request_id: str, *messages: dict[str, Any], policy: str = "queue"
) -> Any:
    request = ChatRequest(request_id, list(messages), "submit-message")
    return turn_accept(conversation_id=conversation.pk, request=request, policy=policy)


@pytest.mark.django_db
def test_a_request_beyond_the_queue_is_refused_and_stores_nothing(
    settings: Any, conversation: Conversation
) -> None:
    settings.THINK = think(MAX_QUEUED_TURNS=2)
    for n in (1, 2):
        assert not accept(conversation, f"r{n}", user(f"u{n}")).refused
    refused = accept(conversation, "r3", user("u3"))
    assert refused.refused == "2 turns are already queued in this conversation; send it when one has run"
    assert refused.fiber_id is None
    assert not Message.objects.filter(message_id="u3").exists()
    assert not Fiber.objects.filter(request_id="r3").exists()
    Fiber.objects.filter(request_id="r1").update(status=Fiber.Status.RUNNING)  # one left the queue
    assert not accept(conversation, "r3", user("u3")).refused


@pytest.mark.django_db
def test_the_latest_policy_replaces_the_queue_instead_of_refusing(
    settings: Any, conversation: Conversation
) -> None:
    settings.THINK = think(MAX_QUEUED_TURNS=1)
    accept(conversation, "r1", user("u1"), policy="latest")
    latest = accept(conversation, "r2", user("u2"), policy="latest")
    assert not latest.refused and latest.superseded == ("r1",)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (user("big", "x" * 300), "message 'big' is larger than 200 bytes"),
        (user("many", parts=4), "message 'many' has 4 parts; at most 3 are accepted"),
    ],
)
def test_a_new_message_over_the_limits_is_refused_and_stores_nothing(
    settings: Any, conversation: Conversation, message: dict[str, Any], reason: str
) -> None:
    settings.THINK = think(MAX_MESSAGE_BYTES=200, MAX_MESSAGE_PARTS=3)
    accept(conversation, "r1", user("u1"))
    Fiber.objects.update(status=Fiber.Status.COMPLETED)
    before = list(Message.objects.values_list("message_id", "parts"))
    refused = accept(conversation, "r2", user("u1"), message)
    assert refused.refused == reason
    assert list(Message.objects.values_list("message_id", "parts")) == before
    assert not Fiber.objects.filter(request_id="r2").exists()


@pytest.mark.django_db
def test_messages_the_server_already_has_are_not_checked(settings: Any, conversation: Conversation) -> None:
    """Clients echo the whole transcript: a long answer the server wrote must not block the next request."""
    long_answer = {"id": "a1", "role": "assistant", "parts": [{"type": "text", "text": "y" * 5_000}] * 9}
    Message.objects.create(
        conversation=conversation, message_id="a1", role="assistant", parts=long_answer["parts"], position=0
    )
    settings.THINK = think(MAX_MESSAGE_BYTES=200, MAX_MESSAGE_PARTS=3)
    compaction = {
        "id": "compaction_1",
        "role": "assistant",
        "parts": [{"type": "text", "text": "z" * 500}],
        "metadata": None,
    }
    accepted = accept(conversation, "r1", compaction, {**long_answer, "metadata": None}, user("u1"))
    assert not accepted.refused and accepted.fiber_id is not None


@pytest.mark.django_db
def test_a_request_adding_more_new_messages_than_the_bound_is_refused_and_stores_nothing(
    settings: Any, conversation: Conversation
) -> None:
    settings.THINK = think(MAX_NEW_MESSAGES=3)
    many = [user(f"m{n}", "") for n in range(4)]
    refused = accept(conversation, "r1", *many)
    assert refused.refused == (
        "it adds 4 new messages, more than the 3 one request may add; send them in smaller requests"
    )
    assert not Message.objects.filter(conversation=conversation).exists()
    assert not Fiber.objects.filter(request_id="r1").exists()


@pytest.mark.django_db
def test_only_messages_the_server_does_not_have_count_as_new(
    settings: Any, conversation: Conversation, django_assert_max_num_queries: Any
) -> None:
    """Clients send the whole transcript each time: a long conversation's echo is not new; the new
    messages are stored in order, in one insert (not a few queries each)."""
    settings.THINK = think(MAX_NEW_MESSAGES=3)
    first = [user(f"m{n}") for n in range(3)]
    assert not accept(conversation, "r1", *first).refused
    Fiber.objects.update(status=Fiber.Status.COMPLETED)
    for n in range(3, 9, 3):  # the echo grows past the bound; each request adds three
        echo = [user(f"m{k}") for k in range(n)]
        with django_assert_max_num_queries(24):
            accepted = accept(conversation, f"r{n}", *echo, *(user(f"m{k}") for k in range(n, n + 3)))
        assert not accepted.refused
        Fiber.objects.update(status=Fiber.Status.COMPLETED)
    stored = list(Message.objects.filter(conversation=conversation).values_list("message_id", "position"))
    assert stored == [(f"m{n}", n) for n in range(9)]


# -- the consumer ----------------------------------------------------------------------------------------
WAITING = [
    {"id": "u-1", "role": "user", "parts": [{"type": "text", "text": "where am I?"}]},
    {
        "id": "a-1",
        "role": "assistant",
        "parts": [
            {"type": "tool-get_location", "toolCallId": "call-1", "state": "input-available", "input": {}}
        ],
    },
]


def chat_request_text(request_id: str, messages: list[dict[str, Any]], padding: int = 0) -> str:
    """A chat request as the published client writes it: id first, type last."""
    body = json.dumps({"messages": messages, "trigger": "submit-message", "pad": "p" * padding})
    return json.dumps(
        {"id": request_id, "init": {"method": "POST", "body": body}, "type": p.USE_CHAT_REQUEST}
    )


@pytest.mark.django_db(transaction=True)
async def test_frames_over_the_rate_are_refused_and_a_chat_request_hears_why() -> None:
    name = new_name("rate")
    conversation_id = await seed_conversation(name, WAITING)
    with override_settings(THINK=think(MAX_FRAMES_PER_S=5.0, MAX_FRAME_BURST=3)):
        with mock.patch("chat.transcript.turns.turn_enqueue") as enqueue:
            async with connected(name) as socket:
                before = await stored_state(conversation_id)
                for _ in range(3):
                    await socket.send_to(text_data='{"type":"no_such_type"}')
                await socket.send_to(
                    text_data=chat_request_text("r-1", [*WAITING, {"id": "u-2", "role": "user"}])
                )
                error = await chat_response(socket, "r-1")
                assert error["done"] is True and error["error"] is True
                assert (
                    error["body"] == "Chat request refused: more than 5 frames a second (after a burst of 3)"
                )
                await asyncio.sleep(0.25)  # a token again: the socket is still open and answers
                answer, _ = await probe(socket)
                assert answer == {"type": p.STREAM_RESUME_NONE, "reason": "idle", "probeId": "probe"}
                assert await stored_state(conversation_id) == before
        assert not enqueue.called


@pytest.mark.django_db(transaction=True)
async def test_a_chat_request_over_the_frame_size_hears_why(caplog: pytest.LogCaptureFixture) -> None:
    name = new_name("frame")
    conversation_id = await seed_conversation(name, WAITING)
    with (
        override_settings(THINK=think(MAX_FRAME_BYTES=5_000)),
        mock.patch("chat.transcript.turns.turn_enqueue") as enqueue,
    ):
        async with connected(name) as socket:
            before = await stored_state(conversation_id)
            with caplog.at_level(logging.WARNING, logger="chat.wire.consumers"):
                await socket.send_to(text_data=chat_request_text("r-big", WAITING, padding=5_000))
                error = await chat_response(socket, "r-big")
            assert error == {
                "type": p.USE_CHAT_RESPONSE,
                "id": "r-big",
                "body": "Invalid chat request: frame is larger than 5000 bytes",
                "done": True,
                "error": True,
            }
            assert "frame refused: frame is larger than 5000 bytes" in caplog.text
            assert await stored_state(conversation_id) == before
    assert not enqueue.called


@pytest.mark.django_db(transaction=True)
async def test_a_chat_request_beyond_the_queue_hears_why() -> None:
    name = new_name("queue")
    conversation_id = await seed_conversation(name, WAITING[:1])
    for n in (1, 2):  # two turns wait behind a busy one
        await database_sync_to_async(fiber_create)(
            conversation_id=conversation_id, request_id=f"q{n}", kind=TurnKind.CHAT, snapshot=None
        )
    with (
        override_settings(THINK=think(MAX_QUEUED_TURNS=2)),
        mock.patch("chat.transcript.turns.turn_enqueue") as enqueue,
    ):
        async with connected(name) as socket:
            before = await stored_state(conversation_id)
            await socket.send_to(
                text_data=chat_request_text("r-3", [*WAITING[:1], {"id": "u-3", "role": "user"}])
            )
            error = await chat_response(socket, "r-3")
            assert error["done"] is True and error["error"] is True
            queued = "2 turns are already queued in this conversation; send it when one has run"
            assert error["body"] == f"Chat request refused: {queued}"
            assert await stored_state(conversation_id) == before
    assert not enqueue.called


@pytest.mark.django_db(transaction=True)
async def test_a_tool_output_over_the_limit_is_logged_and_not_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = new_name("tool")
    conversation_id = await seed_conversation(name, WAITING)
    with (
        override_settings(THINK=think(MAX_TOOL_OUTPUT_BYTES=100)),
        mock.patch("chat.transcript.turns.turn_enqueue") as enqueue,
    ):
        async with connected(name) as socket:
            before = await stored_state(conversation_id)
            result = {
                "type": p.TOOL_RESULT,
                "toolCallId": "call-1",
                "toolName": "get_location",
                "output": "x" * 100,
            }
            with caplog.at_level(logging.WARNING, logger="chat.wire.consumers"):
                await socket.send_to(text_data=json.dumps(result))
                answer, frames = await probe(socket)
            assert answer["reason"] == "idle"
            assert frames == [  # the sender hears why, for its call
                {
                    "type": p.TOOL_REFUSED,
                    "toolCallId": "call-1",
                    "reason": "tool output is larger than 100 bytes",
                }
            ]
            assert "frame refused: tool output is larger than 100 bytes" in caplog.text
            assert await stored_state(conversation_id) == before
    assert not enqueue.called
