"""Limits per principal (THINK["PRINCIPAL_*"]): turns at once, turns a minute, tokens a day.

A principal is whom a conversation belongs to (chat.access), whatever socket or conversation name they
use. Every turn a client can cause is checked: a chat request, and a continuation that a client's tool
result or approval starts (each is a model call). Recovery's own continuations finish a turn that was
accepted, and are bounded by its budget instead (ChatRecovery).

The checks run in the accepting transaction under a Postgres advisory lock on the principal, so two
web processes accepting for the same principal take turns and a limit cannot be overrun by a race. The
counts come from the fibers themselves (active, started in the last minute) and from PrincipalUsage
(tokens of the day, input and output, written when a run finishes). Anonymous visitors (an
`AccessPolicy` with `anonymous_sessions`) get a new principal with every new session cookie, so their
turns are also counted per client address (THINK["ANONYMOUS_TURNS_PER_MINUTE_PER_ADDRESS"]), in the
cache, which must be shared by the web processes (Redis, as in the demo) for the count to be global.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import connection, transaction
from django.utils import timezone

from recovery.models import ACTIVE_STATUSES, Fiber

from ..caching import shared_cache
from ..conf import think_setting
from ..exceptions import ConversationLimit
from ..models import Conversation
from .selectors import conversation_get
from .services import conversation_get_or_create, conversation_insert

_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
_COUNT_TURN = """
INSERT INTO think_chat_principal_usage (principal, day, turns, input_tokens, output_tokens)
VALUES (%s, (now() AT TIME ZONE 'UTC')::date, 1, 0, 0)
ON CONFLICT (principal, day) DO UPDATE SET turns = think_chat_principal_usage.turns + 1
"""
# A finished run's tokens: its input tokens as its fiber recorded them step by step, its output tokens
# as the run counted them. One statement, inside the transaction that finishes the turn.
ADD_TOKENS = """
INSERT INTO think_chat_principal_usage (principal, day, turns, input_tokens, output_tokens)
SELECT %(principal)s, (now() AT TIME ZONE 'UTC')::date, 0, f.input_tokens, %(output)s
FROM think_recovery_fiber f WHERE f.id = %(fiber)s AND (f.input_tokens > 0 OR %(output)s > 0)
ON CONFLICT (principal, day) DO UPDATE
SET input_tokens = think_chat_principal_usage.input_tokens + EXCLUDED.input_tokens,
    output_tokens = think_chat_principal_usage.output_tokens + EXCLUDED.output_tokens
"""
# Everything the limits read, in one statement: the day's tokens, the turns queued or running, and the
# turns started since the given time (the fibers of the principal's conversations).
_USAGE = """
SELECT coalesce(u.input_tokens, 0), coalesce(u.output_tokens, 0), t.active, t.recent
FROM (
    SELECT count(*) FILTER (WHERE f.status = ANY(%s)) AS active,
        count(*) FILTER (WHERE f.created_at >= %s) AS recent
    FROM {fiber} f JOIN think_chat_conversation c ON c.id = f.conversation_id
    WHERE c.owner = %s
) t
LEFT JOIN think_chat_principal_usage u ON u.principal = %s AND u.day = (now() AT TIME ZONE 'UTC')::date
"""
# The principal's conversations, counted up to the bound only (never over all they have).
_OWNED = "SELECT count(*) FROM (SELECT 1 FROM think_chat_conversation WHERE owner = %s LIMIT %s) AS owned"
ANONYMOUS_PREFIX = "session:"  # chat.access: the principal of an anonymous visitor's session


def principal_refusal(principal: str, *, address: str | None = None) -> str:
    """Why a new turn of `principal` (from the client `address`, when known) is over a limit ("" when
    it is not). Call inside the accepting transaction: the lock it takes is held until that ends."""
    if not principal:
        return ""  # server code's conversations (no owner)
    refused = _address_refusal(principal, address)
    if refused:
        return refused
    active = think_setting("PRINCIPAL_MAX_ACTIVE_TURNS")
    per_minute = think_setting("PRINCIPAL_TURNS_PER_MINUTE")
    tokens = think_setting("PRINCIPAL_TOKENS_PER_DAY")
    output = think_setting("PRINCIPAL_OUTPUT_TOKENS_PER_DAY")
    if active is None and per_minute is None and tokens is None and output is None:
        return ""
    since = timezone.now() - timedelta(seconds=60)
    with connection.cursor() as cursor:
        cursor.execute(_LOCK, [f"think-principal:{principal}"])
        # Its own statement, after the lock: it sees every turn committed while the lock was waited for.
        usage = _USAGE.format(fiber=Fiber._meta.db_table)
        cursor.execute(usage, [list(ACTIVE_STATUSES), since, principal, principal])
        used_in, used_out, running, recent = cursor.fetchone()
    if tokens is not None and used_in + used_out >= tokens:
        return f"you have used your {tokens} tokens for today (UTC); try again tomorrow"
    if output is not None and used_out >= output:
        return f"you have used your {output} output tokens for today (UTC); try again tomorrow"
    if active is not None and running >= active:
        return f"you already have {active} turns queued or running; send this when one has finished"
    if per_minute is not None and recent >= per_minute:
        return f"you have started {per_minute} turns in the last minute; wait a moment"
    return ""


def _address_refusal(principal: str, address: str | None) -> str:
    """An anonymous visitor's turn, counted against the client address for a minute from its first."""
    limit = think_setting("ANONYMOUS_TURNS_PER_MINUTE_PER_ADDRESS")
    if limit is None or not address or not principal.startswith(ANONYMOUS_PREFIX):
        return ""
    key, cache = f"think:anonymous-turns:{address}", shared_cache()
    cache.add(key, 0, timeout=60)  # a window that opens with the address's first turn
    if cache.incr(key) > limit:
        return f"more than {limit} turns a minute from your address without signing in; wait a moment"
    return ""


def _address_conversation_counted(owner: str, address: str | None) -> None:
    """One more new conversation of an anonymous visitor from `address`, or ConversationLimit."""
    limit = think_setting("ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS")
    if limit is None or not address or not owner.startswith(ANONYMOUS_PREFIX):
        return
    key, cache = f"think:anonymous-conversations:{address}", shared_cache()
    cache.add(key, 0, timeout=3600)  # a window that opens with the address's first new conversation
    if cache.incr(key) > limit:
        raise ConversationLimit(
            f"more than {limit} new conversations an hour from your address without signing in;"
            " open one you have, or sign in"
        )


def principal_turn_counted(principal: str) -> None:
    """One more turn of `principal` today (in the accepting transaction)."""
    if principal:
        with connection.cursor() as cursor:
            cursor.execute(_COUNT_TURN, [principal])


def conversation_get_or_create_within(
    *, agent: str, name: str, owner: str, address: str | None = None
) -> Conversation:
    """The conversation (agent, name), created for `owner` when new, unless they own
    THINK["PRINCIPAL_MAX_CONVERSATIONS"] already, or `owner` is anonymous and their client `address` has
    opened THINK["ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS"] new ones in the hour:
    ConversationLimit, and nothing is created. Each name is a row, so a client connecting to fresh
    names (with a fresh cookie each time, when anonymous) would otherwise add rows without end."""
    existing = conversation_get(agent=agent, name=name)
    if existing is not None:
        return existing
    _address_conversation_counted(owner, address)
    limit = think_setting("PRINCIPAL_MAX_CONVERSATIONS")
    if limit is None or not owner:  # read just now: insert, and read again only if that lost a race
        created = conversation_insert(agent=agent, name=name, owner=owner)
        return created or conversation_get_or_create(agent=agent, name=name, owner=owner)
    with transaction.atomic():
        with connection.cursor() as cursor:  # two sockets of the principal creating at once take turns
            cursor.execute(_LOCK, [f"think-principal:{owner}"])
            cursor.execute(_OWNED, [owner, limit])
            (owned,) = cursor.fetchone()
        created = conversation_insert(agent=agent, name=name, owner=owner) if owned < limit else None
        # None: over the bound, or another connection created it meanwhile (then it is that one).
        existing = created or conversation_get(agent=agent, name=name)
        if existing is None:
            raise ConversationLimit(
                f"you already have {limit} conversations; open one of them or delete some first"
            )
        return existing
