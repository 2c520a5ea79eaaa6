"""Issue 34, row 11: an anonymous visitor's principal is never a usable credential.

It was "session:<key>", the session cookie itself, shown to every staff user who may view the admin's
conversations and usage; pasted into a ``sessionid`` cookie, it made them that visitor. It is now a keyed
hash of the key (chat.access.session_principal), and migration 0010 rewrites the rows stored before.
"""

from __future__ import annotations

import datetime
import importlib
import re
from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils.crypto import salted_hmac

from chat.access import (
    SESSION_PRINCIPAL_SALT,
    Credentials,
    SessionAccess,
    conversation_open,
    session_principal,
)
from chat.models import Conversation, Message, PrincipalUsage

pytestmark = pytest.mark.django_db

MIGRATION = importlib.import_module("chat.migrations.0010_token_revocation_session_principals")


def anonymous_visitor() -> tuple[Client, str]:
    """A visitor of the demo page (SessionAccess in the test settings): its client and session key."""
    visitor = Client()
    assert visitor.get("/").status_code == 200
    return visitor, visitor.cookies["sessionid"].value


def test_a_view_only_staff_user_never_sees_a_session_key_and_the_principal_is_no_cookie() -> None:
    visitor, key = anonymous_visitor()
    principal = SessionAccess().principal(Credentials(session_key=key))
    conversation = conversation_open(
        agent="assistant", name="anon-chat", credentials=Credentials(session_key=key)
    )
    Message.objects.create(
        conversation=conversation,
        message_id="m1",
        role="user",
        parts=[{"type": "text", "text": "hi"}],
        position=0,
    )
    PrincipalUsage.objects.create(principal=principal, day=datetime.date(2026, 12, 5), turns=1)
    assert visitor.get("/agents/assistant/anon-chat/get-messages").status_code == 200, "the visitor's own"

    staff = User.objects.create_user("viewer", is_staff=True)
    staff.user_permissions.set(
        Permission.objects.filter(codename__in=["view_conversation", "view_principalusage", "view_message"])
    )
    admin = Client()
    admin.force_login(staff)
    usage = PrincipalUsage.objects.get(principal=principal)
    pages = [
        reverse("admin:think_chat_conversation_changelist"),
        reverse("admin:think_chat_conversation_change", args=[conversation.pk]),
        reverse("admin:think_chat_principalusage_changelist"),
        reverse("admin:think_chat_principalusage_change", args=[usage.pk]),
    ]
    shown: set[str] = set()
    for page in pages:
        response = admin.get(page)
        assert response.status_code == 200, page
        body = response.content.decode()
        assert key not in body, page
        shown.update(re.findall(r"session:([0-9a-f]{32})", body))
    assert shown == {principal.removeprefix("session:")}

    # What staff can copy authenticates nobody: as a sessionid cookie it is no session of the visitor.
    for pasted in (principal.removeprefix("session:"), principal):
        thief = Client()
        thief.cookies["sessionid"] = pasted
        response = thief.get("/agents/assistant/anon-chat/get-messages")
        assert response.status_code == 403 and b"parts" not in response.content, pasted


def test_the_principal_is_a_keyed_hash_of_the_session_key(settings: Any) -> None:
    principal = session_principal("abc")
    assert re.fullmatch(r"session:[0-9a-f]{32}", principal) and "abc" not in principal
    assert principal == session_principal("abc") != session_principal("abd")
    settings.SECRET_KEY = "another-secret-key-" + "x" * 40
    assert session_principal("abc") != principal, "keyed: nobody without SECRET_KEY can make or test one"


def test_the_migration_rewrites_raw_session_principals_and_merges_usage_by_summing() -> None:
    assert MIGRATION.SESSION_PRINCIPAL_SALT == SESSION_PRINCIPAL_SALT
    assert MIGRATION.hashed_session_principal("session:k1") == session_principal("k1")
    day, other_day = datetime.date(2026, 12, 4), datetime.date(2026, 12, 5)
    hashed = session_principal("k1")  # "f" and a usage row: written by the new code before migrating
    for name, owner in (
        ("a", "session:k1"),
        ("b", "session:k1"),
        ("c", "session:k2"),
        ("d", "user:7"),
        ("e", ""),
        ("f", hashed),
    ):
        Conversation.objects.create(agent="assistant", name=name, owner=owner)
    PrincipalUsage.objects.create(principal="session:k1", day=day, turns=2, input_tokens=10, output_tokens=3)
    PrincipalUsage.objects.create(principal=hashed, day=day, turns=5, input_tokens=100, output_tokens=30)
    PrincipalUsage.objects.create(
        principal="session:k1", day=other_day, turns=1, input_tokens=1, output_tokens=1
    )
    PrincipalUsage.objects.create(principal="user:7", day=day, turns=9, input_tokens=9, output_tokens=9)

    MIGRATION.rewrite_session_principals(apps, None)

    owners = dict(Conversation.objects.values_list("name", "owner"))
    assert owners == {
        "a": hashed,
        "b": hashed,
        "c": session_principal("k2"),
        "d": "user:7",
        "e": "",
        "f": hashed,
    }
    rows = {
        (usage.principal, usage.day): (usage.turns, usage.input_tokens, usage.output_tokens)
        for usage in PrincipalUsage.objects.all()
    }
    assert rows == {
        (hashed, day): (7, 110, 33),  # merged: every counter summed
        (hashed, other_day): (1, 1, 1),
        ("user:7", day): (9, 9, 9),
    }
    assert not any(principal.startswith("session:k") for principal, _ in rows)


def test_the_migration_hash_is_the_one_the_policy_makes() -> None:
    expected = "session:" + salted_hmac(SESSION_PRINCIPAL_SALT, "zz", algorithm="sha256").hexdigest()[:32]
    assert session_principal("zz") == expected == MIGRATION.hashed_session_principal("session:zz")
