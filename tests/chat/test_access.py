"""Access control (chat.access): principals, tokens, ownership, and every door that checks them.

The consumer runs in-process on the real channel layer and database (tests/chat/sockets.py); the
HTTP views through Django's test client. tests/e2e/test_access.py and tests/e2e/test_hostsite.py
do the same through daphne, with session cookies and a host site's own user model.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser
from django.core import signing
from django.core.management import CommandError, call_command
from django.test import Client

from chat.access import (
    TOKEN_SALT,
    AccessDenied,
    AccessPolicy,
    Credentials,
    SessionAccess,
    UserAccess,
    access_policy,
    conversation_open,
    conversation_read,
    issue_token,
    session_principal,
    token_principal,
    user_principal,
)
from chat.agents import open_agent
from chat.checks import check_think_settings
from chat.models import Conversation, Message
from chat.tokens import revoke_principal_tokens, revoke_token, token_claims
from recovery.checks import check_recovery_deploy, check_recovery_settings
from tests.chat.sockets import APPLICATION, TIMEOUT_S, new_name, seed_conversation, stored_state
from tests.operator_support import terminate_new_backends
from tests.support import TEST_PRINCIPAL, access_token, user_message

ALICE, BOB = "test:alice", "test:bob"


@pytest.fixture(scope="module", autouse=True)
def close_db_thread_connections(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    yield from terminate_new_backends(django_db_blocker)


class Session:
    def __init__(self, key: str | None) -> None:
        self.session_key = key


def backdated_token(principal: str, seconds: int) -> str:
    class Backdated(signing.TimestampSigner):
        def timestamp(self) -> str:
            return signing.b62_encode(int(time.time()) - seconds)

    claims = {"p": principal, "id": uuid.uuid4().hex, "iat": time.time() - seconds}
    return Backdated(salt=TOKEN_SALT).sign_object(claims, compress=True)


# -- tokens --------------------------------------------------------------------------------------------
@pytest.mark.django_db
def test_a_token_stands_for_its_principal() -> None:
    assert token_principal(issue_token(ALICE)) == ALICE


@pytest.mark.django_db
def test_a_token_expires(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "TOKEN_MAX_AGE_S": 60}
    assert token_principal(backdated_token(ALICE, 30)) == ALICE
    with pytest.raises(AccessDenied, match="expired"):
        token_principal(backdated_token(ALICE, 120))


@pytest.mark.parametrize(
    "forged",
    [
        lambda: issue_token(ALICE)[:-2] + "xx",  # tampered signature
        lambda: signing.dumps(ALICE),  # signed for another purpose (salt)
        lambda: signing.dumps(ALICE, salt=TOKEN_SALT, key="another-secret"),
        lambda: signing.dumps(42, salt=TOKEN_SALT),  # not a principal
        lambda: signing.dumps(ALICE, salt=TOKEN_SALT, compress=True),  # the first format: no id to revoke
        lambda: signing.dumps({"p": ALICE, "iat": time.time()}, salt=TOKEN_SALT),  # no id
        lambda: signing.dumps({"p": ALICE, "id": "x", "iat": "now"}, salt=TOKEN_SALT),
        lambda: "not-a-token",
        lambda: "",
    ],
)
def test_a_forged_token_is_refused(forged: Any) -> None:
    with pytest.raises(AccessDenied, match="not valid"):
        token_principal(forged())


@pytest.mark.django_db
def test_a_token_is_refused_once_revoked_by_its_id_or_with_every_older_token_of_its_principal() -> None:
    first, second, bobs = issue_token(ALICE), issue_token(ALICE), issue_token(BOB)
    revoke_token(first)
    with pytest.raises(AccessDenied, match="revoked"):
        token_principal(first)
    assert token_principal(second) == ALICE, "one token only"
    revoke_token(token_claims(second).token_id)  # by the id think_token prints
    with pytest.raises(AccessDenied, match="revoked"):
        token_principal(second)
    older = issue_token(ALICE)
    revoke_principal_tokens(ALICE)
    newer = issue_token(ALICE)
    with pytest.raises(AccessDenied, match="revoked"):
        token_principal(older)
    assert token_principal(newer) == ALICE and token_principal(bobs) == BOB
    revoke_principal_tokens(ALICE)  # again: the moment moves on
    with pytest.raises(AccessDenied, match="revoked"):
        token_principal(newer)


@pytest.mark.django_db
def test_a_users_token_is_refused_once_the_user_is_inactive_or_gone() -> None:
    user = get_user_model().objects.create_user("dora")
    token = issue_token(f"user:{user.pk}")
    assert token_principal(token) == f"user:{user.pk}"
    user.is_active = False
    user.save()
    with pytest.raises(AccessDenied, match="not active"):
        token_principal(token)
    user.is_active = True
    user.save()
    assert token_principal(token) == f"user:{user.pk}"
    user.delete()
    with pytest.raises(AccessDenied, match="not active"):
        token_principal(token)
    with pytest.raises(AccessDenied, match="not active"):  # not a primary key at all
        token_principal(issue_token("user:not-a-number"))
    with pytest.raises(AccessDenied, match="not active"):  # beyond an integer key's range: no such user
        token_principal(issue_token("user:99999999999999999999"))


def test_a_token_needs_a_principal() -> None:
    with pytest.raises(ValueError):
        issue_token("")


# -- credentials and principals ------------------------------------------------------------------------
def test_credentials_from_a_scope() -> None:
    token = issue_token(ALICE)
    scope = {"query_string": f"_pk=1&token={token}".encode(), "session": Session("k1"), "user": "u"}
    assert Credentials.from_scope(scope) == Credentials(user="u", session_key="k1", token=token)
    header = {"query_string": b"", "headers": [(b"Authorization", f"Bearer {token}".encode())]}
    assert Credentials.from_scope(header).token == token
    assert Credentials.from_scope({}) == Credentials()
    assert Credentials.from_scope({"query_string": b"token="}).token is None


@pytest.mark.django_db
def test_principals_of_users_sessions_and_tokens() -> None:
    user = get_user_model().objects.create_user("alice")
    inactive = get_user_model().objects.create_user("carol", is_active=False)
    users, sessions = UserAccess(), SessionAccess()
    assert user_principal(user) == f"user:{user.pk}"
    assert user_principal(inactive) is None and user_principal(AnonymousUser()) is None
    assert users.principal(Credentials(user=user)) == f"user:{user.pk}"
    assert sessions.principal(Credentials(user=user, session_key="k")) == f"user:{user.pk}"
    anonymous = sessions.principal(Credentials(user=AnonymousUser(), session_key="k"))
    assert (
        anonymous == session_principal("k") and anonymous.startswith("session:") and anonymous != "session:k"
    )
    for policy in (users, sessions):
        assert policy.principal(Credentials(token=issue_token(BOB), user=user)) == BOB, "a token wins"
        with pytest.raises(AccessDenied, match="not valid"):  # never falls back to the session
            policy.principal(Credentials(token="forged", user=user))
    for anonymous in (Credentials(), Credentials(user=inactive), Credentials(user=AnonymousUser())):
        with pytest.raises(AccessDenied, match="authentication required"):
            sessions.principal(anonymous)
    with pytest.raises(AccessDenied, match="authentication required"):
        users.principal(Credentials(user=AnonymousUser(), session_key="k"))


def test_the_policy_comes_from_the_settings(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "ACCESS_POLICY": "chat.access.UserAccess"}
    assert type(access_policy()) is UserAccess
    settings.THINK = {**settings.THINK, "ACCESS_POLICY": "chat.access.Credentials"}
    with pytest.raises(TypeError, match="not an AccessPolicy subclass"):
        access_policy()


# -- ownership -----------------------------------------------------------------------------------------
def as_(principal: str) -> Credentials:
    return Credentials(token=issue_token(principal))


@pytest.mark.django_db
def test_whoever_opens_a_conversation_first_owns_it() -> None:
    conversation = conversation_open(agent="assistant", name="mine", credentials=as_(ALICE))
    assert conversation.owner == ALICE
    assert conversation_open(agent="assistant", name="mine", credentials=as_(ALICE)).pk == conversation.pk
    with pytest.raises(AccessDenied, match="belongs to someone else"):
        conversation_open(agent="assistant", name="mine", credentials=as_(BOB))
    with pytest.raises(AccessDenied, match="belongs to someone else"):
        conversation_read(agent="assistant", name="mine", credentials=as_(BOB))
    assert conversation_read(agent="assistant", name="mine", credentials=as_(ALICE)) == conversation


@pytest.mark.django_db
def test_nobody_opens_a_conversation_without_an_owner() -> None:
    Conversation.objects.create(agent="assistant", name="server-only")
    with pytest.raises(AccessDenied):
        conversation_open(agent="assistant", name="server-only", credentials=as_(ALICE))
    assert Conversation.objects.get(name="server-only").owner == "", "refusing claims nothing"


@pytest.mark.django_db
def test_an_anonymous_caller_creates_nothing() -> None:
    with pytest.raises(AccessDenied):
        conversation_open(agent="assistant", name="anon", credentials=Credentials())
    assert not Conversation.objects.filter(name="anon").exists()


@pytest.mark.django_db
def test_reading_never_creates() -> None:
    assert conversation_read(agent="assistant", name="nothing-yet", credentials=as_(ALICE)) is None
    assert not Conversation.objects.filter(name="nothing-yet").exists()


@pytest.mark.django_db
def test_open_agent_gives_a_conversation_to_its_owner() -> None:
    agent = open_agent("assistant", "programmatic")
    assert Conversation.objects.get(pk=agent.conversation_id).owner == ""
    assert open_agent("assistant", "programmatic", owner=ALICE).conversation_id == agent.conversation_id
    assert Conversation.objects.get(pk=agent.conversation_id).owner == ALICE, "an unowned one is claimed"
    open_agent("assistant", "programmatic")  # no owner: keeps the one it has
    assert Conversation.objects.get(pk=agent.conversation_id).owner == ALICE
    with pytest.raises(AccessDenied, match="belongs to someone else"):
        open_agent("assistant", "programmatic", owner=BOB)
    assert Conversation.objects.get(pk=agent.conversation_id).owner == ALICE
    assert Conversation.objects.get(pk=open_agent("assistant", "new", owner=BOB).conversation_id).owner == BOB


@pytest.mark.django_db
def test_a_custom_policy_decides(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "ACCESS_POLICY": f"{__name__}.TeamAccess"}
    conversation = conversation_open(agent="assistant", name="team", credentials=as_("team:red:ann"))
    assert conversation.owner == "team:red:ann"
    assert conversation_open(agent="assistant", name="team", credentials=as_("team:red:bo")) == conversation
    with pytest.raises(AccessDenied):
        conversation_open(agent="assistant", name="team", credentials=as_("team:blue:cy"))


class TeamAccess(AccessPolicy):
    """Members of a team share its conversations."""

    def may_access(self, principal: str, conversation: Conversation) -> bool:
        return principal.split(":")[:2] == conversation.owner.split(":")[:2]


# -- the WebSocket ---------------------------------------------------------------------------------------
async def refused(path: str) -> tuple[int, list[dict[str, Any]]]:
    """Connect, and read until the server closes: its close code and the frames it sent before."""
    communicator = WebsocketCommunicator(APPLICATION, path)
    accepted, _ = await communicator.connect(timeout=TIMEOUT_S)
    assert accepted
    frames = []
    while True:
        message = await communicator.receive_output(timeout=TIMEOUT_S)
        if message["type"] == "websocket.close":
            # The client goes as a closed socket does, and the consumer ends (raising what it raised):
            # wait() alone would wait out its whole timeout, as the consumer waits for the disconnect.
            await communicator.disconnect(code=message["code"], timeout=TIMEOUT_S)
            return message["code"], frames
        frames.append(json.loads(message["text"]))


@pytest.mark.django_db(transaction=True)
async def test_a_stranger_gets_4403_and_not_one_frame() -> None:
    name = new_name("owned")
    conversation_id = await seed_conversation(name, [user_message("a secret")])  # TEST_PRINCIPAL's
    before = await stored_state(conversation_id)
    for path in (
        f"/agents/assistant/{name}?token={access_token(BOB)}",  # someone else
        f"/agents/assistant/{name}",  # nobody
        f"/agents/assistant/{name}?token=forged",
        f"/agents/assistant/{name}?token={backdated_token(TEST_PRINCIPAL, 10**6)}",  # the owner's, expired
    ):
        code, frames = await refused(path)
        assert code == 4403, path
        assert frames == [], f"{path}: nothing of the conversation leaks before the close"
    assert await stored_state(conversation_id) == before


@pytest.mark.django_db(transaction=True)
async def test_frames_a_stranger_sends_anyway_change_nothing() -> None:
    """A client that ignores the close and keeps sending (read, write, cancel, clear, resume)."""
    name = new_name("owned")
    conversation_id = await seed_conversation(name, [user_message("mine")])
    before = await stored_state(conversation_id)
    communicator = WebsocketCommunicator(APPLICATION, f"/agents/assistant/{name}?token={access_token(BOB)}")
    await communicator.connect(timeout=TIMEOUT_S)
    assert (await communicator.receive_output(timeout=TIMEOUT_S))["code"] == 4403
    request = {"messages": [user_message("not yours")], "trigger": "submit-message"}
    for frame in (
        {
            "type": "cf_agent_use_chat_request",
            "id": "r1",
            "init": {"method": "POST", "body": json.dumps(request)},
        },
        {"type": "cf_agent_chat_request_cancel", "id": "r1"},
        {"type": "cf_agent_chat_clear"},
        {"type": "cf_agent_stream_resume_request", "probeId": "p"},
    ):
        await communicator.send_input({"type": "websocket.receive", "text": json.dumps(frame)})
    assert await communicator.receive_nothing(timeout=0.5)
    await communicator.disconnect(code=4403, timeout=TIMEOUT_S)
    assert await stored_state(conversation_id) == before


@pytest.mark.django_db(transaction=True)
async def test_the_owner_gets_in_by_token_or_session() -> None:
    name = new_name("by-session")
    await database_sync_to_async(Conversation.objects.create)(
        agent="assistant", name=name, owner=session_principal("s1")
    )
    for scope_session, expected_close in ((Session("s1"), None), (Session("s2"), 4403), (None, 4403)):
        communicator = WebsocketCommunicator(APPLICATION, f"/agents/assistant/{name}")
        communicator.scope["session"] = scope_session
        communicator.scope["user"] = AnonymousUser()
        await communicator.connect(timeout=TIMEOUT_S)
        first = await communicator.receive_output(timeout=TIMEOUT_S)
        if expected_close is None:
            assert json.loads(first["text"])["type"] == "cf_agent_chat_messages"
            await communicator.disconnect(timeout=TIMEOUT_S)
        else:
            assert first == {"type": "websocket.close", "code": expected_close, "reason": first.get("reason")}


# -- get-messages, the page, /metrics ------------------------------------------------------------------
def stored_conversation(name: str, owner: str) -> None:
    conversation = Conversation.objects.create(agent="assistant", name=name, owner=owner)
    Message.objects.create(
        conversation=conversation,
        message_id="m1",
        role="user",
        parts=[{"type": "text", "text": "hello"}],
        position=0,
    )


@pytest.mark.django_db
def test_get_messages_is_for_the_owner_only(client: Client) -> None:
    stored_conversation("transcript", ALICE)
    url = "/agents/assistant/transcript/get-messages"
    owner = client.get(url, HTTP_AUTHORIZATION=f"Bearer {issue_token(ALICE)}")
    assert owner.status_code == 200 and [m["role"] for m in owner.json()] == ["user"]
    assert client.get(url, {"token": issue_token(ALICE)}).status_code == 200
    for refused_response in (
        client.get(url, HTTP_AUTHORIZATION=f"Bearer {issue_token(BOB)}"),
        client.get(url),
        client.get(url, HTTP_AUTHORIZATION="Bearer forged"),
    ):
        assert refused_response.status_code == 403
        assert (
            "messages" not in refused_response.content.decode()
            and "hello" not in refused_response.content.decode()
        )
    assert client.get(url, HTTP_AUTHORIZATION=f"Bearer {issue_token(BOB)}").json() == {
        "error": "this conversation belongs to someone else"
    }
    fresh = client.get("/agents/assistant/never-used/get-messages", {"token": issue_token(BOB)})
    assert fresh.status_code == 200 and fresh.json() == []


@pytest.mark.django_db
def test_get_messages_with_a_logged_in_user(client: Client) -> None:
    user = get_user_model().objects.create_user("dora")
    stored_conversation("doras", f"user:{user.pk}")
    assert client.get("/agents/assistant/doras/get-messages").status_code == 403
    client.force_login(user)
    assert client.get("/agents/assistant/doras/get-messages").json()[0]["role"] == "user"


@pytest.mark.django_db
def test_the_page_gives_a_visitor_a_session_or_a_login(client: Client, settings: Any) -> None:
    settings.THINK = {**settings.THINK, "ACCESS_POLICY": "chat.access.SessionAccess"}
    page = client.get("/")
    assert page.status_code == 200 and "sessionid" in page.cookies, "an anonymous visitor gets a session"
    settings.THINK = {**settings.THINK, "ACCESS_POLICY": "chat.access.UserAccess"}
    anonymous = Client().get("/")
    assert anonymous.status_code == 302 and anonymous["Location"].startswith(f"{settings.LOGIN_URL}?next=/")
    member = Client()
    member.force_login(get_user_model().objects.create_user("erin"))
    assert member.get("/").status_code == 200


@pytest.mark.django_db
def test_metrics_want_the_token_when_one_is_set(client: Client, settings: Any) -> None:
    assert client.get("/metrics").status_code == 200
    settings.THINK = {**settings.THINK, "METRICS_TOKEN": "s3cret"}
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer wrong"}, {"HTTP_AUTHORIZATION": "Basic s3cret"}):
        response = client.get("/metrics", **headers)
        assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize(
    "headers",
    [
        {"REMOTE_ADDR": "10.1.2.3"},
        {"REMOTE_ADDR": "203.0.113.9"},
        {"REMOTE_ADDR": "127.0.0.1", "HTTP_X_FORWARDED_FOR": "127.0.0.1"},
        {"REMOTE_ADDR": "::1", "HTTP_FORWARDED": "for=127.0.0.1"},
        {"REMOTE_ADDR": "127.0.0.1", "HTTP_X_REAL_IP": "10.0.0.1"},
        {"REMOTE_ADDR": ""},
    ],
)
def test_metrics_without_a_token_are_for_this_machine_only(
    client: Client, settings: Any, headers: dict[str, str]
) -> None:
    """Issue 34 row 7: the demo served /metrics to anyone. Without a token only a loopback client that
    came through no proxy (a header that says so, true or forged) is served."""
    settings.THINK = {**settings.THINK, "METRICS_TOKEN": None}
    response = client.get("/metrics", **headers)
    assert response.status_code == 403
    assert b"think_" not in response.content
    assert client.get("/metrics", REMOTE_ADDR="::1").status_code == 200
    settings.THINK = {**settings.THINK, "METRICS_TOKEN": "s3cret"}
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret", **headers).status_code == 200


# -- checks and the command ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("think", "error_id"),
    [
        ({"ACCESS_POLICY": "chat.nowhere.Policy"}, "think_chat.E008"),
        ({"ACCESS_POLICY": "chat.access.Credentials"}, "think_chat.E008"),
        ({"ACCESS_POLICY": 42}, "think_chat.E008"),
        ({"TOKEN_MAX_AGE_S": 0}, "think_chat.E005"),
    ],
)
def test_misconfigured_access_fails_the_checks(settings: Any, think: dict[str, Any], error_id: str) -> None:
    settings.THINK = {**settings.THINK, **think}
    assert [message.id for message in check_think_settings()] == [error_id]


@pytest.mark.parametrize("token", ["", 123])
def test_a_bad_metrics_token_fails_the_recovery_checks(settings: Any, token: Any) -> None:
    settings.THINK = {**settings.THINK, "METRICS_TOKEN": token}
    assert [m.id for m in check_recovery_settings()] == ["think_recovery.E004"]


def test_the_deploy_check_warns_about_open_metrics(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "METRICS_TOKEN": None}
    assert [message.id for message in check_recovery_deploy()] == [
        "think_recovery.I001",
        "think_recovery.W001",
    ]
    settings.THINK = {**settings.THINK, "METRICS_TOKEN": "s3cret"}
    assert [message.id for message in check_recovery_deploy()] == ["think_recovery.I001"]


@pytest.mark.django_db
def test_think_token_prints_a_token_for_a_user_or_a_principal() -> None:
    user = get_user_model().objects.create_user("fay")
    out = io.StringIO()
    call_command("think_token", "--user", "fay", stdout=out, stderr=io.StringIO())
    assert token_principal(out.getvalue().strip()) == f"user:{user.pk}"
    out = io.StringIO()
    call_command("think_token", "--principal", "service:reporting", stdout=out, stderr=io.StringIO())
    assert token_principal(out.getvalue().strip()) == "service:reporting"
    get_user_model().objects.create_user("gus", is_active=False)
    tokens = [issue_token("service:reporting") for _ in range(3)]
    call_command("think_token", "--revoke", tokens[0], stdout=io.StringIO())
    call_command("think_token", "--revoke", token_claims(tokens[1]).token_id, stdout=io.StringIO())
    for revoked in tokens[:2]:
        with pytest.raises(AccessDenied, match="revoked"):
            token_principal(revoked)
    assert token_principal(tokens[2]) == "service:reporting"
    call_command("think_token", "--revoke-all", "service:reporting", stdout=io.StringIO())
    with pytest.raises(AccessDenied, match="revoked"):
        token_principal(tokens[2])
    for args, message in (
        (["--revoke", "forged:token:value"], "not a token of this site"),
        (["--revoke-all", " "], "needs a principal"),
        (["--user", "nobody"], "no user"),
        (["--user", "gus"], "not active"),
        (["--principal", " "], "empty"),
    ):
        with pytest.raises(CommandError, match=message):
            call_command("think_token", *args, stdout=io.StringIO(), stderr=io.StringIO())
