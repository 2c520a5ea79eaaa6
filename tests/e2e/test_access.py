"""Access control through daphne: Django session cookies on the socket and on get-messages, tokens,
and the page in two browsers that are not each other.

The test settings use the demo's SessionAccess: logged-in users are "user:<pk>", anonymous visitors
own what they open through their session, tokens stand for whoever they were issued to.
"""

from __future__ import annotations

import asyncio
import io
import json
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from chat.models import Conversation
from tests.e2e.test_page import allow_sync_db_beside_playwright, browser, open_page  # noqa: F401
from tests.support import ChatClient, access_token, assistant_text, chat_request, numbers, user_message

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def login(username: str) -> str:
    """A Django login as the site's own login view makes it; the sessionid cookie's value."""
    user = get_user_model().objects.create_user(username)
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def get_messages(port: int, name: str, cookie: str | None, *, token: str | None = None) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{port}/agents/assistant/{name}/get-messages"
    headers = {"Cookie": cookie} if cookie else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def test_a_logged_in_user_chats_over_the_session_cookie(stack: Any) -> None:
    tag = uuid.uuid4().hex[:6]
    alice = "sessionid=" + await sync_to_async(login)(f"alice-{tag}")
    bob = "sessionid=" + await sync_to_async(login)(f"bob-{tag}")
    name = f"acc-{tag}"
    async with ChatClient(stack.port, name, principal=None, cookie=alice) as client:
        await client.recv_type("cf_agent_identity")
        await client.send(chat_request("r1", [user_message("count to 7")]))
        log = await client.follow("r1", timeout=30)
    assert log.text == numbers(7) and log.done is not None and log.done["outcome"] == "completed"
    conversation = await Conversation.objects.aget(agent="assistant", name=name)
    alice_user = await get_user_model().objects.aget(username=f"alice-{tag}")
    assert conversation.owner == f"user:{alice_user.pk}"

    status, body = await sync_to_async(get_messages)(stack.port, name, alice)
    assert status == 200 and assistant_text(json.loads(body)) == numbers(7)

    for intruder in (
        ChatClient(stack.port, name, principal=None, cookie=bob),  # another user
        ChatClient(stack.port, name, principal=None),  # no credentials at all
        ChatClient(stack.port, name, principal="test:someone-else"),  # a valid token, not the owner's
    ):
        async with intruder:
            assert await intruder.close_code() == 4403
            assert intruder.frames == []
    for cookie in (bob, None):
        status, body = await sync_to_async(get_messages)(stack.port, name, cookie)
        assert status == 403 and b"parts" not in body
    # The owner's conversation is as it was: one user message, one answer.
    status, body = await sync_to_async(get_messages)(stack.port, name, alice)
    assert [m["role"] for m in json.loads(body)] == ["user", "assistant"]


async def test_a_page_on_another_port_or_scheme_of_the_host_cannot_use_the_cookie(stack: Any) -> None:
    """Issue 34, row 9: a host-only Origin match let a page on http://127.0.0.1:8080 (or on https) open a
    cookie-authenticated socket to the site on http://127.0.0.1:<port>. The origin is scheme, host and
    port: those handshakes are refused with 403 before the consumer runs; the page's own origin works."""
    import websockets

    tag = uuid.uuid4().hex[:6]
    cookie = "sessionid=" + await sync_to_async(login)(f"carol-{tag}")
    name = f"origin-{tag}"
    url = f"ws://127.0.0.1:{stack.port}/agents/assistant/{name}"
    for origin in (
        "http://127.0.0.1:8080",  # another port of the same host
        f"https://127.0.0.1:{stack.port}",  # the same host and port, another scheme
        "https://127.0.0.1",
        f"http://localhost:{stack.port}",  # another host, though one of ALLOWED_HOSTS
        "null",  # a sandboxed page or a file
    ):
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url, origin=origin, additional_headers={"Cookie": cookie}):
                pass
        assert refused.value.response.status_code == 403, origin
    assert not await Conversation.objects.filter(name=name).aexists()

    # The site's own page, by either name the host has (the Host header says which).
    async with websockets.connect(
        url, origin=f"http://127.0.0.1:{stack.port}", additional_headers={"Cookie": cookie}
    ) as ws:
        frames = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(2)]
    assert frames[-1]["type"] == "cf_agent_identity"
    local = f"ws://localhost:{stack.port}/agents/assistant/{name}"
    async with websockets.connect(
        local, origin=f"http://LOCALHOST:{stack.port}", additional_headers={"Cookie": cookie}
    ) as ws:
        frames = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(2)]
    assert frames[-1]["type"] == "cf_agent_identity"


async def test_a_token_is_refused_once_its_user_is_inactive_or_gone_or_it_is_revoked(stack: Any) -> None:
    """Issue 34, row 8: a token was checked only for its signature, so a deactivated or deleted user, or
    a token the site meant to withdraw, kept access until it expired. Each is now refused at connect
    (4403, no frame) and on get-messages (403)."""
    tag = uuid.uuid4().hex[:6]
    users = get_user_model().objects
    erin = await users.acreate_user(f"erin-{tag}")
    fred = await users.acreate_user(f"fred-{tag}")
    erin_p, fred_p = f"user:{erin.pk}", f"user:{fred.pk}"
    name, fred_name = f"tok-{tag}", f"tok-fred-{tag}"
    for principal, conversation in ((erin_p, name), (fred_p, fred_name)):
        async with ChatClient(stack.port, conversation, principal=principal) as client:
            assert (await client.recv_type("cf_agent_identity"))["type"] == "cf_agent_identity"

    async def refused(principal: str, conversation: str, token: str | None = None) -> None:
        client = ChatClient(stack.port, conversation, principal=principal)
        if token is not None:
            client.url = client.url.split("&token=")[0] + f"&token={token}"
        async with client:
            assert await client.close_code() == 4403
            assert client.frames == []
        status, body = await sync_to_async(get_messages)(
            stack.port, conversation, None, token=token or access_token(principal)
        )
        assert status == 403 and b"parts" not in body

    erin.is_active = False
    await erin.asave(update_fields=["is_active"])
    await refused(erin_p, name)
    await fred.adelete()
    await refused(fred_p, fred_name)

    # Revoked: one token by its id; then every token of a principal issued before --revoke-all.
    gail_p = f"service:gail-{tag}"
    gail_name = f"tok-gail-{tag}"
    revoked, kept = access_token(gail_p), access_token(gail_p)
    out = io.StringIO()
    await sync_to_async(call_command)("think_token", "--revoke", revoked, stdout=out)
    await refused(gail_p, gail_name, revoked)
    status, _ = await sync_to_async(get_messages)(stack.port, gail_name, None, token=kept)
    assert status == 200
    await sync_to_async(call_command)("think_token", "--revoke-all", gail_p, stdout=out)
    await refused(gail_p, gail_name, kept)
    newer = access_token(gail_p)
    client = ChatClient(stack.port, gail_name, principal=gail_p)
    client.url = client.url.split("&token=")[0] + f"&token={newer}"
    async with client:
        assert (await client.recv_type("cf_agent_identity"))["type"] == "cf_agent_identity"
    status, _ = await sync_to_async(get_messages)(stack.port, gail_name, None, token=newer)
    assert status == 200


async def test_an_anonymous_visitor_reopens_their_conversation_whose_owner_is_no_cookie(stack: Any) -> None:
    """Issue 34, row 11: the owner stored for an anonymous visitor was "session:<key>", their cookie. It is
    now a keyed hash of the key; the visitor, reconnecting with the same cookie, still gets their
    conversation, and the stored owner, pasted as a cookie, gets nothing."""

    def visit() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/", timeout=10) as response:
            cookies = response.headers.get_all("Set-Cookie") or []
        return next(c.split(";")[0] for c in cookies if c.startswith("sessionid="))

    cookie = await sync_to_async(visit)()
    key = cookie.removeprefix("sessionid=")
    name = f"anon-{uuid.uuid4().hex[:6]}"
    async with ChatClient(stack.port, name, principal=None, cookie=cookie) as client:
        await client.recv_type("cf_agent_identity")
        await client.send(chat_request("r1", [user_message("count to 4")]))
        log = await client.follow("r1", timeout=30)
    assert log.text == numbers(4)
    owner = (await Conversation.objects.aget(agent="assistant", name=name)).owner
    assert owner.startswith("session:") and key not in owner

    async with ChatClient(stack.port, name, principal=None, cookie=cookie) as again:
        messages = await again.recv_type("cf_agent_chat_messages")
    assert assistant_text(messages["messages"]) == numbers(4)
    for pasted in (owner.removeprefix("session:"), owner):
        async with ChatClient(stack.port, name, principal=None, cookie=f"sessionid={pasted}") as thief:
            assert await thief.close_code() == 4403 and thief.frames == []


def test_a_second_browser_cannot_open_the_first_ones_conversation(stack: Any, browser: Any) -> None:  # noqa: F811
    """Two anonymous visitors (two browser contexts, two sessions): the conversation is the first's."""
    name = f"page-acc-{uuid.uuid4().hex[:8]}"
    page = open_page(browser, stack.port, name)
    page.fill("#message-input", "count to 9")
    page.click("#send-button")
    page.wait_for_function(
        "window.thinkChat.messages().some(m => m.role === 'assistant')"
        " && window.thinkChat.status() === 'idle'",
        timeout=20_000,
    )
    assert assistant_text(page.evaluate("window.thinkChat.messages()")) == numbers(9)

    stranger = browser.new_page()  # a new context: no cookies of the first
    stranger.goto(f"http://127.0.0.1:{stack.port}/#{name}")
    stranger.wait_for_function(
        "document.getElementById('error-text').textContent.includes('4403')", timeout=15_000
    )
    assert "access denied" in stranger.inner_text("#error-text")
    assert stranger.evaluate("window.thinkChat.messages()") == []
    assert "1 2 3" not in stranger.inner_text("#messages")

    # The owner, reloading, still has everything.
    page.reload()
    page.wait_for_function(
        "window.thinkChat && window.thinkChat.messages().some(m => m.role === 'assistant')", timeout=15_000
    )
    assert assistant_text(page.evaluate("window.thinkChat.messages()")) == numbers(9)
    stranger.close()
    page.close()
