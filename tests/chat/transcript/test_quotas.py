"""Limits per principal (THINK["PRINCIPAL_*"]): on by default, over all of a principal's conversations,
two principals apart, atomic between concurrent accepting processes, a turn's input and output tokens
counted to its owner, continuations that a client's answer starts checked too, and anonymous visitors
counted per client address as well."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client, override_settings
from django.utils import timezone

from chat.agents import open_agent
from chat.checks import PRINCIPAL_LIMITS, check_think_settings
from chat.conf import DEFAULTS
from chat.models import Conversation, Message, PrincipalUsage
from chat.protocol import ChatRequest
from chat.transcript import turns
from chat.transcript.finish import TurnOutcome, turn_finish
from chat.transcript.turns import turn_accept
from recovery.lease.fibers import fiber_claim
from recovery.models import Fiber, Stream
from tests.support import numbers

ALICE, BOB = "user:alice", "user:bob"


def limits(**values: Any) -> Any:
    """The limits as given, the others off (the suite's settings lift them: tests/settings.py)."""
    from django.conf import settings

    off = dict.fromkeys(PRINCIPAL_LIMITS)
    named = {
        (k.upper() if k.startswith("anonymous") else f"PRINCIPAL_{k.upper()}"): v for k, v in values.items()
    }
    return override_settings(THINK={**settings.THINK, **off, **named})


def conversation(owner: str, name: str) -> Conversation:
    return Conversation.objects.create(agent="assistant", name=name, owner=owner)


def ask(chat: Conversation, request_id: str) -> Any:
    message = {"id": f"u-{request_id}", "role": "user", "parts": [{"type": "text", "text": "hi"}]}
    return turn_accept(conversation_id=chat.pk, request=ChatRequest(request_id, [message], "submit-message"))


def finish(chat: Conversation, request_id: str, output_tokens: int = 0, input_tokens: int = 0) -> None:
    fiber = Fiber.objects.get(conversation=chat, request_id=request_id)
    Fiber.objects.filter(pk=fiber.pk).update(input_tokens=input_tokens)  # as its steps recorded them
    claim = fiber_claim(fiber_id=fiber.pk, owner="test")
    assert claim is not None
    message = {"id": f"a-{request_id}", "role": "assistant", "parts": [{"type": "text", "text": "ok"}]}
    outcome = TurnOutcome(
        Fiber.Status.COMPLETED, Stream.Status.COMPLETED, message, output_tokens=output_tokens
    )
    turn_finish(
        fiber_id=fiber.pk, fencing=claim.fencing, conversation_id=chat.pk, stream_id=None, outcome=outcome
    )


def stored(chat: Conversation) -> tuple[int, int]:
    return Message.objects.filter(conversation=chat).count(), Fiber.objects.filter(conversation=chat).count()


@pytest.mark.django_db
def test_active_turns_count_over_every_conversation_of_a_principal() -> None:
    a1, a2, a3, b1 = (conversation(ALICE, "a1"), conversation(ALICE, "a2"), conversation(ALICE, "a3"),
                      conversation(BOB, "b1"))  # fmt: skip
    with limits(max_active_turns=2):
        assert not ask(a1, "r1").refused and not ask(a2, "r2").refused
        refused = ask(a3, "r3")
        assert "2 turns queued or running" in refused.refused and stored(a3) == (0, 0), "nothing stored"
        assert not ask(b1, "r4").refused, "another principal is not held back"
        finish(a1, "r1")
        assert not ask(a3, "r5").refused, "one finished: room again"
    assert PrincipalUsage.objects.get(principal=ALICE).turns == 3


@pytest.mark.django_db
def test_turns_per_minute() -> None:
    a1, b1 = conversation(ALICE, "a1"), conversation(BOB, "b1")
    with limits(turns_per_minute=2):
        for request_id in ("r1", "r2"):
            assert not ask(a1, request_id).refused
            finish(a1, request_id)
        refused = ask(a1, "r3")
        assert "2 turns in the last minute" in refused.refused and stored(a1) == (4, 2)
        assert not ask(b1, "r4").refused
        Fiber.objects.filter(conversation=a1).update(created_at=timezone.now() - timedelta(seconds=61))
        assert not ask(a1, "r5").refused


@pytest.mark.django_db
def test_output_tokens_per_day_are_counted_when_a_run_finishes() -> None:
    a1, b1 = conversation(ALICE, "a1"), conversation(BOB, "b1")
    with limits(output_tokens_per_day=10):
        assert not ask(a1, "r1").refused
        finish(a1, "r1", output_tokens=12)
        assert "your 10 output tokens for today" in ask(a1, "r2").refused
        assert not ask(b1, "r3").refused
    usage = PrincipalUsage.objects.get(principal=ALICE)
    assert (usage.turns, usage.output_tokens, usage.day) == (1, 12, timezone.now().date())


@pytest.mark.django_db
def test_server_code_conversations_are_not_limited() -> None:
    server = conversation("", "s1")
    with limits(max_active_turns=1):
        assert not ask(server, "r1").refused and not ask(server, "r2").refused
    assert not PrincipalUsage.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_accepts_cannot_overrun_a_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four accepting threads (own database sessions, as separate web processes have) for one principal
    with a limit of one: the lock makes them take turns, so exactly one gets in. Each holds its
    transaction a moment after its check, which without the lock lets them all see room."""
    chats = [conversation(ALICE, f"a{i}") for i in range(4)]
    checked = turns.principal_refusal

    def slow_check(principal: str, **kwargs: Any) -> str:
        refusal = checked(principal, **kwargs)
        time.sleep(0.3)
        return refusal

    monkeypatch.setattr(turns, "principal_refusal", slow_check)
    results: list[Any] = [None] * 4
    start = threading.Barrier(4)

    def accept(i: int) -> None:
        try:
            start.wait()
            results[i] = ask(chats[i], f"r{i}")
        finally:
            connection.close()

    with limits(max_active_turns=1):
        threads = [threading.Thread(target=accept, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert sorted(bool(r.refused) for r in results) == [False, True, True, True]
    assert Fiber.objects.filter(conversation__owner=ALICE).count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "10"])
def test_a_bad_limit_is_a_system_check_error(value: Any) -> None:
    with limits(max_active_turns=value):
        assert [e.id for e in check_think_settings()] == ["think_chat.E024"]
    with limits(max_active_turns=None, turns_per_minute=5):
        assert check_think_settings() == []


@pytest.mark.django_db
def test_the_admin_shows_the_use(admin_client: Client) -> None:
    a1 = conversation(ALICE, "a1")
    with limits(max_active_turns=5):
        ask(a1, "r1")
    response = admin_client.get("/admin/think_chat/principalusage/")
    assert response.status_code == 200
    row = response.content.decode()
    assert ALICE in row and '<td class="field-active_turns">1</td>' in row


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("in_process_model")
async def test_a_turns_output_tokens_come_from_the_models_usage() -> None:
    from asgiref.sync import sync_to_async

    agent = await sync_to_async(open_agent)("assistant", "tokens", owner=ALICE)
    result = await agent.achat(["count to 7"], timeout=30)
    assert result.text == numbers(7)
    usage = await PrincipalUsage.objects.aget(principal=ALICE)
    assert usage.output_tokens == 7, "the scripted model reports one output token per number"


def test_the_limits_are_on_by_default() -> None:
    on = {key: DEFAULTS[key] for key in PRINCIPAL_LIMITS if DEFAULTS[key] is not None}
    assert set(on) == {
        "PRINCIPAL_MAX_ACTIVE_TURNS",
        "PRINCIPAL_TURNS_PER_MINUTE",
        "PRINCIPAL_TOKENS_PER_DAY",
        "ANONYMOUS_TURNS_PER_MINUTE_PER_ADDRESS",
        "PRINCIPAL_MAX_SOCKETS",
        "ANONYMOUS_SOCKETS_PER_ADDRESS",
        "PRINCIPAL_MAX_CONVERSATIONS",
        "ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS",
        "PRINCIPAL_REPLAYS_PER_MINUTE",
        "PRINCIPAL_FILE_BYTES_PER_DAY",
        "ANONYMOUS_FILE_BYTES_PER_DAY_PER_ADDRESS",
    }


@pytest.mark.django_db
def test_the_defaults_refuse_a_flood_of_turns() -> None:
    """At the defaults (no override of any limit), a principal cannot keep more turns running than
    PRINCIPAL_MAX_ACTIVE_TURNS, each in a conversation of its own."""
    from django.conf import settings

    active = DEFAULTS["PRINCIPAL_MAX_ACTIVE_TURNS"]
    at_defaults = {k: v for k, v in settings.THINK.items() if k not in PRINCIPAL_LIMITS}
    with override_settings(THINK=at_defaults):
        results = [ask(conversation(ALICE, f"flood-{i}"), f"r{i}") for i in range(active + 1)]
    assert [bool(r.refused) for r in results] == [False] * active + [True]


@pytest.mark.django_db
def test_input_tokens_count_against_the_day() -> None:
    """A client that sends large inputs (a long transcript, big clientTools schemas) spends input tokens:
    they count against PRINCIPAL_TOKENS_PER_DAY with the output."""
    a1, b1 = conversation(ALICE, "a1"), conversation(BOB, "b1")
    with limits(tokens_per_day=1000):
        assert not ask(a1, "r1").refused
        finish(a1, "r1", output_tokens=5, input_tokens=996)
        assert "your 1000 tokens for today" in ask(a1, "r2").refused
        assert not ask(b1, "r3").refused
    usage = PrincipalUsage.objects.get(principal=ALICE)
    assert (usage.input_tokens, usage.output_tokens) == (996, 5)


def answer_client_tool(chat: Conversation, call: str) -> Any:
    from chat.transcript.interactions import interaction_apply

    Message.objects.create(
        conversation=chat,
        message_id=f"a-{call}",
        role="assistant",
        parts=[{"type": "tool-ask_user", "toolCallId": call, "state": "input-available", "input": {}}],
        position=Message.objects.filter(conversation=chat).count(),
    )
    update = {"kind": "result", "toolCallId": call, "output": "ok", "autoContinue": True, "serverTools": []}
    return interaction_apply(conversation_id=chat.pk, update=update)


@pytest.mark.django_db
def test_a_continuation_a_client_answer_starts_is_a_turn_under_the_limits() -> None:
    """Chaining continuations through client tool results is no way around the limits: each is a
    model call. Over the limit the answer is stored, and the continuation does not start."""
    a1 = conversation(ALICE, "a1")
    with limits(turns_per_minute=2):
        assert not ask(a1, "r1").refused
        finish(a1, "r1")
        first = answer_client_tool(a1, "c1")
        assert first.continuation_request_id and not first.refused
        Fiber.objects.filter(request_id=first.continuation_request_id).update(status=Fiber.Status.COMPLETED)
        second = answer_client_tool(a1, "c2")
        assert second.status == "applied" and second.continuation_request_id is None
        assert "2 turns in the last minute" in second.refused
    assert Fiber.objects.filter(conversation=a1).count() == 2
    assert Message.objects.get(message_id="a-c2").parts[0]["output"] == "ok", "the answer is kept"
    assert PrincipalUsage.objects.get(principal=ALICE).turns == 2


@pytest.mark.django_db
def test_anonymous_visitors_are_counted_per_address_too() -> None:
    """A new session cookie is a new principal: a loop of 'new cookie, chat' from one address is
    refused after the address's turns for the minute, whatever the session."""
    sessions = [conversation(f"session:{i}", f"s{i}") for i in range(3)]
    with limits(anonymous_turns_per_minute_per_address=2):
        asked = [
            turn_accept(
                conversation_id=chat.pk,
                request=ChatRequest(f"r{i}", [user(i)], "submit-message"),
                address="203.0.113.7",
            )
            for i, chat in enumerate(sessions)
        ]
        assert [bool(a.refused) for a in asked] == [False, False, True]
        assert "from your address without signing in" in asked[2].refused
        other = turn_accept(
            conversation_id=sessions[2].pk,
            request=ChatRequest("r-other", [user(9)], "submit-message"),
            address="198.51.100.1",
        )
        assert not other.refused, "another address is not held back"
        signed_in = turn_accept(
            conversation_id=conversation(ALICE, "a1").pk,
            request=ChatRequest("r-alice", [user(10)], "submit-message"),
            address="203.0.113.7",
        )
        assert not signed_in.refused, "a signed-in user is counted as themselves"


def user(i: int) -> dict[str, Any]:
    return {"id": f"u-anon-{i}", "role": "user", "parts": [{"type": "text", "text": "hi"}]}


@pytest.mark.django_db(transaction=True)
async def test_a_refused_continuation_is_told_to_the_client() -> None:
    """Over the socket: the client's answer is stored and announced, and the continuation it would start
    is refused with an error the client shows (a stream of its own that ends at once)."""
    import json

    from channels.db import database_sync_to_async

    from chat import protocol as p
    from tests.chat.sockets import connected, new_name, receive_until, seed_conversation

    name = new_name("quota")
    call = {"type": "tool-ask_user", "toolCallId": "c1", "state": "input-available", "input": {}}
    conversation_id = await seed_conversation(
        name,
        [
            {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]},
            {"id": "a1", "role": "assistant", "parts": [call]},
        ],
    )
    await Fiber.objects.acreate(
        conversation_id=conversation_id, request_id="r1", status=Fiber.Status.COMPLETED
    )
    answer = {"type": "cf_agent_tool_result", "toolCallId": "c1", "output": "Ada", "autoContinue": True}
    with limits(turns_per_minute=1):
        async with connected(name) as client:
            await client.send_to(text_data=json.dumps(answer))
            frames = await receive_until(client, lambda f: f["type"] == p.USE_CHAT_RESPONSE)
            frames += await receive_until(client, lambda f: f["type"] == p.MESSAGE_UPDATED)
    [refusal] = [f for f in frames if f["type"] == p.USE_CHAT_RESPONSE]
    assert refusal["error"] is True and refusal["done"] is True
    assert refusal["body"].startswith("Continuation refused: you have started 1 turns in the last minute")
    assert frames[-1]["message"]["parts"][0]["output"] == "Ada", "the answer itself was taken"
    assert await database_sync_to_async(Fiber.objects.filter(conversation_id=conversation_id).count)() == 1
