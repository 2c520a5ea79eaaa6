"""The apps embedded in another site (tests/hostsite): its daphne, Celery worker and beat, the chat under
/support/, a streamed turn, the page, and a worker SIGKILLed mid-stream.

The host processes use pytest's test database (THINK_TEST_DATABASE_NAME), so this process can check
what they stored; the host's own tables (its user model) are not needed by anything they run here.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
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
from tests.support import (
    ChatClient,
    Proc,
    assistant_text,
    chat_request,
    follow_conversation,
    numbers,
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

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, b""


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
def worker(host: HostSite) -> Proc:
    """A running host worker, started by the first test that needs one."""
    return host.workers[-1] if host.workers else host.start_worker()


def new_name(tag: str) -> str:
    return f"host-{tag}-{uuid.uuid4().hex[:8]}"


async def start_turn(client: ChatClient, text: str) -> str:
    request_id = uuid.uuid4().hex[:10]
    await client.send(chat_request(request_id, [user_message(text)]))
    return request_id


def transcript(host: HostSite, name: str) -> list[dict[str, Any]]:
    status, body = host.get(f"{PREFIX}/agents/{AGENT}/{name}/get-messages")
    assert status == 200
    return json.loads(body)  # type: ignore[no-any-return]


async def test_a_turn_streams_under_the_prefix(host: HostSite, worker: Proc) -> None:
    name = new_name("turn")
    async with ChatClient(host.port, name, agent=AGENT, prefix=PREFIX) as client:
        identity = await client.recv_type("cf_agent_identity")
        assert identity == {"type": "cf_agent_identity", "name": name, "agent": AGENT}
        request_id = await start_turn(client, "count to 30")
        log = await client.follow(request_id, timeout=30)
    assert log.errors == [] and log.text == numbers(30)
    assert log.seqs == list(range(len(log.seqs)))
    assert log.done is not None and log.done["outcome"] == "completed"

    stored = await sync_to_async(transcript)(host, name)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert assistant_text(stored) == numbers(30)
    conversation = await Conversation.objects.aget(agent=AGENT, name=name)
    fiber = await Fiber.objects.aget(request_id=request_id)
    assert fiber.conversation_id == conversation.pk and fiber.status == Fiber.Status.COMPLETED

    # The chat lives under the prefix only; the root is the host's own.
    assert (await sync_to_async(host.get)(f"/agents/{AGENT}/{name}/get-messages"))[0] == 404
    assert (await sync_to_async(host.get)("/"))[1] == b"The host site's own home page."
    assert (await sync_to_async(host.get)("/ops/metrics"))[0] == 200


def test_the_page_connects_under_the_prefix(host: HostSite, worker: Proc) -> None:
    """The page served at /support/ opens its socket and fetches its transcript under /support/."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    sync_api = pytest.importorskip("playwright.sync_api")
    if chromium is None:
        pytest.skip("no chromium")
    name = new_name("page")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
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
    assert assistant_text(transcript(host, name)) == numbers(12)


async def test_a_worker_killed_mid_stream_is_recovered(host: HostSite) -> None:
    host.stop_workers()
    victim = await asyncio.to_thread(host.start_worker)
    name = new_name("kill")
    async with ChatClient(host.port, name, agent=AGENT, prefix=PREFIX) as client:
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
    stored = await sync_to_async(transcript)(host, name)
    assert [m["role"] for m in stored].count("user") == 1
    assert assistant_text(stored) == numbers(60)
    fiber = await Fiber.objects.aget(request_id=request_id)
    assert fiber.status == Fiber.Status.RECOVERED
