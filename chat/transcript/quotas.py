"""Limits per principal (THINK["PRINCIPAL_*"]): turns at once, turns a minute, output tokens a day.

A principal is whom a conversation belongs to (chat.access), whatever socket or conversation name they
use. The checks run in the accepting transaction under a Postgres advisory lock on the principal, so two
web processes accepting for the same principal take turns and a limit cannot be overrun by a race. The
counts come from the fibers themselves (active, started in the last minute) and from PrincipalUsage
(tokens of the day, written when a run finishes). Nothing is looked up or locked while no limit is set.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import connection
from django.utils import timezone

from recovery.models import Fiber

from ..conf import think_setting
from .snapshot import TurnKind

_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
_COUNT_TURN = """
INSERT INTO think_chat_principal_usage (principal, day, turns, output_tokens)
VALUES (%s, (now() AT TIME ZONE 'UTC')::date, 1, 0)
ON CONFLICT (principal, day) DO UPDATE SET turns = think_chat_principal_usage.turns + 1
"""
ADD_TOKENS = """
INSERT INTO think_chat_principal_usage (principal, day, turns, output_tokens)
VALUES (%s, (now() AT TIME ZONE 'UTC')::date, 0, %s)
ON CONFLICT (principal, day) DO UPDATE
SET output_tokens = think_chat_principal_usage.output_tokens + EXCLUDED.output_tokens
"""
_TOKENS_TODAY = """
SELECT output_tokens FROM think_chat_principal_usage
WHERE principal = %s AND day = (now() AT TIME ZONE 'UTC')::date
"""


def principal_refusal(principal: str) -> str:
    """Why a new turn of `principal` is over a limit ("" when it is not). Call inside the accepting
    transaction: the lock it takes is held until that transaction ends."""
    active = think_setting("PRINCIPAL_MAX_ACTIVE_TURNS")
    per_minute = think_setting("PRINCIPAL_TURNS_PER_MINUTE")
    per_day = think_setting("PRINCIPAL_OUTPUT_TOKENS_PER_DAY")
    if not principal or (active is None and per_minute is None and per_day is None):
        return ""
    with connection.cursor() as cursor:
        cursor.execute(_LOCK, [f"think-principal:{principal}"])
        if per_day is not None:
            cursor.execute(_TOKENS_TODAY, [principal])
            row = cursor.fetchone()
            if row is not None and row[0] >= per_day:
                return f"you have used your {per_day} output tokens for today (UTC); try again tomorrow"
    mine = Fiber.objects.filter(conversation__owner=principal)
    if active is not None and mine.active().count() >= active:
        return f"you already have {active} turns queued or running; send this when one has finished"
    if per_minute is not None:
        since = timezone.now() - timedelta(seconds=60)
        if mine.filter(kind=TurnKind.CHAT, created_at__gte=since).count() >= per_minute:
            return f"you have started {per_minute} turns in the last minute; wait a moment"
    return ""


def principal_turn_counted(principal: str) -> None:
    """One more turn of `principal` today (in the accepting transaction)."""
    if principal:
        with connection.cursor() as cursor:
            cursor.execute(_COUNT_TURN, [principal])
