"""Limits per principal (THINK["PRINCIPAL_*"]): over all of a principal's conversations, two principals
apart, atomic between concurrent accepting processes, and a turn's output tokens counted to its owner."""

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
from chat.checks import check_think_settings
from chat.models import Conversation, Message, PrincipalUsage
from chat.transcript import turns
from chat.transcript.finish import TurnOutcome, turn_finish
from chat.transcript.turns import turn_accept
from chat.wire.protocol import ChatRequest
from recovery.fibers import fiber_claim
from recovery.models import Fiber, Stream
from tests.support import numbers

ALICE, BOB = "user:alice", "user:bob"


def limits(**values: Any) -> Any:
    from django.conf import settings

    return override_settings(
        THINK={**settings.THINK, **{f"PRINCIPAL_{k.upper()}": v for k, v in values.items()}}
    )


def conversation(owner: str, name: str) -> Conversation:
    return Conversation.objects.create(agent="assistant", name=name, owner=owner)


def ask(chat: Conversation, request_id: str) -> Any:
    message = {"id": f"u-{request_id}", "role": "user", "parts": [{"type": "text", "text": "hi"}]}
    return turn_accept(conversation_id=chat.pk, request=ChatRequest(request_id, [message], "submit-message"))


def finish(chat: Conversation, request_id: str, output_tokens: int = 0) -> None:
    fiber = Fiber.objects.get(conversation=chat, request_id=request_id)
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

    def slow_check(principal: str) -> str:
        refusal = checked(principal)
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
