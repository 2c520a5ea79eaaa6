"""The apps embedded in another site (tests/hostsite): its daphne, Celery worker and beat, the chat under
/support/, a streamed turn, the page, and a worker SIGKILLed mid-stream.

The host processes use pytest's test database (THINK_TEST_DATABASE_NAME), so this process can check
what they stored. That database was migrated with the demo's apps, so the fixture adds the host's own
user table and logs a host user in: the host keeps the apps' default access policy (Django logins), and
every socket and transcript read here goes through that user's session cookie.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from asgiref.sync import sync_to_async
from django.conf import settings

from chat.models import Conversation
from recovery.models import Fiber
from tests.e2e.test_page import sync_api
from tests.support import (
    ROOT,
    ChatClient,
    Proc,
    assistant_text,
    chat_request,
    follow_conversation,
    http_get,
    numbers,
    require,
    start_beat,
    start_daphne,
    start_worker,
    user_message,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

PREFIX = "/support"
AGENT = "helpdesk"
CELERY_APP = "tests.hostsite"


class HostSite:
    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.workers: list[Proc] = []
        self.daphne, self.port = start_daphne(env, log_dir, application="tests.hostsite.asgi:application")
        self.beat = start_beat(env, log_dir, app=CELERY_APP)

    def start_worker(self) -> Proc:
        worker = start_worker(self.env, self.log_dir, name="host-worker", app=CELERY_APP)
        self.workers.append(worker)
        return worker

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers.clear()

    def login(self, username: str) -> str:
        """Log `username` (a host `accounts.User`, created if new) in; the value of the sessionid cookie."""
        script = textwrap.dedent(
            f"""
            import django
            django.setup()
            from django.contrib.auth import get_user_model
            from django.db import connection
            from django.test import Client
            User = get_user_model()
            if User._meta.db_table not in connection.introspection.table_names():
                with connection.schema_editor() as editor:
                    editor.create_model(User)
                    # Without its group and permission links: pytest's flush truncates the tables
                    # they would reference, and no test here needs them.
                    editor.delete_model(User.groups.through)
                    editor.delete_model(User.user_permissions.through)
            user, _ = User.objects.get_or_create(username={username!r}, defaults={{"display_name": "Host"}})
            client = Client()
            client.force_login(user)
            print(client.cookies["sessionid"].value)
            """
        )
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    def get(self, path: str, session: str | None = None) -> tuple[int, bytes]:
        return http_get(self.port, path, session)


@pytest.fixture(scope="module")
def host(stack_environment: dict[str, str], log_dir: Path) -> Iterator[HostSite]:
    env = {**stack_environment, "DJANGO_SETTINGS_MODULE": "tests.hostsite.settings"}
    site = HostSite(env, log_dir)
    yield site
    site.stop_workers()
    site.daphne.stop()
    site.beat.stop()
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(f"thinkhost-{settings.RUN_ID}")  # type: ignore[misc]


@pytest.fixture
def session(host: HostSite) -> str:
    """The sessionid of a logged-in host user (each test's sockets and reads are theirs); per test,
    because pytest empties the session table after each one."""
    return host.login("host-alice")


def host_client(host: HostSite, name: str, session: str) -> ChatClient:
    return ChatClient(
        host.port, name, agent=AGENT, prefix=PREFIX, principal=None, cookie=f"sessionid={session}"
    )


@pytest.fixture
def worker(host: HostSite) -> Proc:
    """A running host worker, started by the first test that needs one."""
    return host.workers[-1] if host.workers else host.start_worker()


def new_name(tag: str) -> str:
    return f"host-{tag}-{uuid.uuid4().hex[:8]}"


def host_user_ids(host: HostSite) -> dict[str, int]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT username, id FROM accounts_user")
        return dict(cursor.fetchall())


async def start_turn(client: ChatClient, text: str) -> str:
    request_id = uuid.uuid4().hex[:10]
    await client.send(chat_request(request_id, [user_message(text)]))
    return request_id


def transcript(host: HostSite, name: str, session: str) -> list[dict[str, Any]]:
    status, body = host.get(f"{PREFIX}/agents/{AGENT}/{name}/get-messages", session)
    assert status == 200
    return json.loads(body)  # type: ignore[no-any-return]


async def test_a_turn_streams_under_the_prefix(host: HostSite, worker: Proc, session: str) -> None:
    name = new_name("turn")
    async with host_client(host, name, session) as client:
        identity = await client.recv_type("cf_agent_identity")
        assert identity == {"type": "cf_agent_identity", "name": name, "agent": AGENT}
        request_id = await start_turn(client, "count to 30")
        log = await client.follow(request_id, timeout=30)
    assert log.errors == [] and log.text == numbers(30)
    assert log.seqs == list(range(len(log.seqs)))
    assert log.done is not None and log.done["outcome"] == "completed"

    stored = await sync_to_async(transcript)(host, name, session)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert assistant_text(stored) == numbers(30)
    conversation = await Conversation.objects.aget(agent=AGENT, name=name)
    host_user_id = (await sync_to_async(host_user_ids)(host))["host-alice"]
    assert conversation.owner == f"user:{host_user_id}", "the host's own user owns what they opened"
    fiber = await Fiber.objects.aget(request_id=request_id)
    assert fiber.conversation_id == conversation.pk and fiber.status == Fiber.Status.COMPLETED

    # The chat lives under the prefix only; the root is the host's own.
    assert (await sync_to_async(host.get)(f"/agents/{AGENT}/{name}/get-messages", session))[0] == 404
    assert (await sync_to_async(host.get)("/"))[1] == b"The host site's own home page."
    assert (await sync_to_async(host.get)("/ops/metrics"))[0] == 200


def test_the_page_connects_under_the_prefix(host: HostSite, worker: Proc, session: str) -> None:
    """The page served at /support/ opens its socket and fetches its transcript under /support/."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    playwright_api = sync_api()
    require(chromium is not None, "no Chromium: apt-get install chromium")
    assert chromium is not None
    name = new_name("page")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            context = browser.new_context()
            context.add_cookies(
                [{"name": "sessionid", "value": session, "url": f"http://127.0.0.1:{host.port}"}]
            )
            page = context.new_page()
            page.goto(f"http://127.0.0.1:{host.port}{PREFIX}/#{name}")
            page.wait_for_function("window.thinkChat && window.thinkChat.status() === 'idle'", timeout=15_000)
            socket_url = page.evaluate("window.thinkChat.socket().url")
            page.fill("#message-input", "count to 12")
            page.click("#send-button")
            page.wait_for_function(
                "window.thinkChat.messages().some(m => m.role === 'assistant')"
                " && window.thinkChat.status() === 'idle'",
                timeout=20_000,
            )
            messages = page.evaluate("window.thinkChat.messages()")
        finally:
            browser.close()
    assert socket_url.startswith(f"ws://127.0.0.1:{host.port}{PREFIX}/agents/{AGENT}/{name}?")
    assert assistant_text(messages) == numbers(12)
    assert assistant_text(transcript(host, name, session)) == numbers(12)


async def test_a_worker_killed_mid_stream_is_recovered(host: HostSite, session: str) -> None:
    host.stop_workers()
    victim = await asyncio.to_thread(host.start_worker)
    name = new_name("kill")
    async with host_client(host, name, session) as client:
        request_id = await start_turn(client, "count to 60 [rate 25]")
        log = await follow_conversation(
            client, until=lambda log: len(log.stream(request_id).chunks) >= 15, timeout=30
        )
        victim.kill(signal.SIGKILL)
        await asyncio.to_thread(host.start_worker)
        await follow_conversation(client, log, timeout=40)

    assert len(log.order) >= 2, "a continuation carried the turn on"
    for stream in log.streams.values():
        assert stream.seqs == list(range(len(stream.seqs)))
    assert log.text == numbers(60), "every number exactly once"
    assert True in log.recovering and log.recovering[-1] is False
    stored = await sync_to_async(transcript)(host, name, session)
    assert [m["role"] for m in stored].count("user") == 1
    assert assistant_text(stored) == numbers(60)
    fiber = await Fiber.objects.aget(request_id=request_id)
    assert fiber.status == Fiber.Status.RECOVERED


async def test_only_the_logged_in_owner_gets_in(host: HostSite, worker: Proc, session: str) -> None:
    """The host keeps the apps' default policy: its own users' logins, nobody else."""
    name = new_name("owner")
    async with host_client(host, name, session) as client:
        request_id = await start_turn(client, "count to 5")
        assert (await client.follow(request_id, timeout=30)).text == numbers(5)

    bob = await asyncio.to_thread(host.login, "host-bob")
    for intruder in (
        host_client(host, name, bob),  # another user of the host
        ChatClient(host.port, name, agent=AGENT, prefix=PREFIX, principal=None),  # nobody
        ChatClient(host.port, name, agent=AGENT, prefix=PREFIX),  # a token signed with another key
    ):
        async with intruder:
            assert await intruder.close_code() == 4403
            assert intruder.frames == [], "not one frame of the conversation before the close"
    path = f"{PREFIX}/agents/{AGENT}/{name}/get-messages"
    assert (await sync_to_async(host.get)(path, bob))[0] == 403
    assert (await sync_to_async(host.get)(path))[0] == 403
    assert assistant_text(await sync_to_async(transcript)(host, name, session)) == numbers(5)

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(opener.open, f"http://127.0.0.1:{host.port}{PREFIX}/", timeout=10)
    assert refused.value.code == 302, "the page sends an anonymous visitor to the login page"
    assert refused.value.headers["Location"].startswith("/accounts/login/?next=/support/")
