"""README's "Add to an existing site", as a new user follows it: `django-admin startproject mysite`, then
exactly the README's blocks pasted into the files they name, and nothing else. The site runs its own
daphne, Celery worker and beat on a database and a Redis of its own, with the scripted model; a user logs
in through the admin's login page in Chromium and chats, a tool runs, the admin and the health endpoint
answer, and a worker SIGKILLed mid-stream is recovered.

The apps come from this checkout (the editable install), which is what the wheel holds
(tests/test_packaging.py checks that file by file).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.conf import settings

from tests.e2e.test_page import sync_api
from tests.support import (
    BIN,
    ROOT,
    ChatClient,
    Proc,
    assistant_text,
    chat_request,
    follow_conversation,
    free_port,
    http_get,
    numbers,
    require,
    start_beat,
    start_daphne,
    start_worker,
    user_message,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SECTION = "## Add to an existing site"
BLOCK_RE = re.compile(r"```python\n# (mysite/[\w/.]+) \((append|new|replace)\)\n(.*?)```", re.DOTALL)
PASSWORD = "readme-site-password"
AGENT = "support"


def readme_blocks() -> list[tuple[str, str, str]]:
    """(file, how, code) of every block of the README's embedding section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    return BLOCK_RE.findall(section)


def test_the_readme_section_names_a_file_for_every_python_block() -> None:
    """A block the site test could not place would silently go untested."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    assert section.count("```python") == len(readme_blocks()) >= 6
    assert {path for path, _, _ in readme_blocks()} >= {
        "mysite/settings.py",
        "mysite/urls.py",
        "mysite/asgi.py",
        "mysite/agents.py",
        "mysite/celery.py",
        "mysite/__init__.py",
    }


@dataclass
class Site:
    root: Path
    env: dict[str, str]
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)
    port: int = 0

    def manage(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    def start_worker(self) -> Proc:
        worker = start_worker(self.env, self.log_dir, name="readme-worker", app="mysite")
        self.workers.append(worker)
        return worker

    def get(self, path: str, session: str | None = None) -> tuple[int, bytes]:
        return http_get(self.port, path, session)


def build_site(root: Path) -> None:
    """startproject, then the README's blocks, each where it says."""
    subprocess.run([str(BIN / "django-admin"), "startproject", "mysite", str(root)], check=True, timeout=60)
    for path, how, code in readme_blocks():
        target = root / path
        if how == "append":
            target.write_text(target.read_text() + "\n" + code)
        else:
            assert (how == "new") != target.exists(), (
                f"{path}: '{how}' but the file {'is' if target.exists() else 'is not'} there"
            )
            target.write_text(code)


def database(name: str, *, create: bool) -> None:
    params = settings.DATABASES["default"]
    with psycopg.connect(
        dbname="postgres",
        user=params["USER"],
        host=params["HOST"],
        port=params["PORT"] or 5432,
        password=params["PASSWORD"],
        autocommit=True,
    ) as conn:
        if create:
            conn.execute(f'CREATE DATABASE "{name}"')
        else:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, log_dir: Path, scripted_model: Any) -> Iterator[Site]:
    redis_server = shutil.which("redis-server")
    require(redis_server is not None, "no redis-server: apt-get install redis-server")
    assert redis_server is not None
    root = tmp_path_factory.mktemp("readme-site")
    build_site(root)
    db_name = f"readme_site_{uuid.uuid4().hex[:8]}"
    redis_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "THINK_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="mysite.settings",
        PYTHONPATH=str(root),
        PGDATABASE=db_name,
        PGHOST=str(settings.DATABASES["default"]["HOST"]),
        PGPORT=str(settings.DATABASES["default"]["PORT"] or 5432),
        PGUSER=str(settings.DATABASES["default"]["USER"]),
        REDIS_URL=f"redis://127.0.0.1:{redis_port}",
        SCRIPTED_MODEL_URL=scripted_model.url,
        PROMETHEUS_MULTIPROC_DIR=str(root / ".metrics"),
        DJANGO_SUPERUSER_PASSWORD=PASSWORD,
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        PYTHONUNBUFFERED="1",
    )
    (root / ".metrics").mkdir()
    built = Site(root, env, log_dir)
    redis_proc = Proc(
        "readme-redis",
        [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        env,
        log_dir / "readme-redis.log",
    ).start()
    built.procs.append(redis_proc)
    database(db_name, create=True)
    try:
        built.manage("check")
        built.manage("migrate", "--noinput")
        built.manage("createsuperuser", "--noinput", "--username", "admin", "--email", "admin@example.com")
        daphne, built.port = start_daphne(env, log_dir, application="mysite.asgi:application")
        built.procs += [daphne, start_beat(env, log_dir, app="mysite")]
        built.start_worker()
        yield built
    finally:
        for proc in [*built.workers, *built.procs]:
            proc.stop()
        database(db_name, create=False)


@pytest.fixture(scope="module")
def session(site: Site) -> Iterator[str]:
    """Log in as the admin through the admin's login page, in Chromium, where the page sends a visitor;
    then chat on the page. The session cookie is what the later tests use."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    require(chromium is not None, "no Chromium: apt-get install chromium")
    playwright_api = sync_api()
    base = f"http://127.0.0.1:{site.port}"
    statics: dict[str, int] = {}
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.on(
                "response", lambda r: statics.__setitem__(r.url, r.status) if "/static/" in r.url else None
            )
            page.goto(f"{base}/support/")
            assert page.url.startswith(f"{base}/admin/login/?next=/support/"), page.url
            page.fill("#id_username", "admin")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url(f"{base}/support/")
            name = f"page-{uuid.uuid4().hex[:8]}"
            page.goto(f"{base}/support/#{name}")
            page.wait_for_function("window.thinkChat && window.thinkChat.status() === 'idle'", timeout=15_000)
            page.fill("#message-input", "count to 12")
            page.click("#send-button")
            page.wait_for_function(
                "window.thinkChat.messages().some(m => m.role === 'assistant')"
                " && window.thinkChat.status() === 'idle'",
                timeout=20_000,
            )
            messages = page.evaluate("window.thinkChat.messages()")
            [cookie] = [c for c in page.context.cookies() if c["name"] == "sessionid"]
        finally:
            browser.close()
    assert assistant_text(messages) == numbers(12)
    assert any(url.endswith("/static/chat/app.js") for url in statics), statics
    # app.js is an ES module: the page and the protocol client come as modules it imports.
    assert any(url.endswith("/static/chat/client/folding.js") for url in statics), statics
    assert any(url.endswith("/static/chat/app.css") for url in statics), statics
    assert set(statics.values()) <= {200, 304}, f"static files under daphne: {statics}"
    yield cookie["value"]


def client(site: Site, name: str, session: str) -> ChatClient:
    return ChatClient(
        site.port, name, AGENT, prefix="/support", principal=None, cookie=f"sessionid={session}"
    )


def transcript(site: Site, name: str, session: str) -> list[dict[str, Any]]:
    status, body = site.get(f"/support/agents/{AGENT}/{name}/get-messages", session)
    assert status == 200, body
    return json.loads(body)  # type: ignore[no-any-return]


async def test_a_tool_runs(site: Site, session: str) -> None:
    name = f"tool-{uuid.uuid4().hex[:8]}"
    async with client(site, name, session) as chat:
        await chat.send(chat_request("t1", [user_message('[tool order_status {"order": "A-17"}]')]))
        log = await chat.follow("t1", timeout=30)
    assert log.errors == [] and log.text == "Tool order_status returned: Order A-17 of admin ships tomorrow."
    [part] = [
        p for m in transcript(site, name, session) for p in m["parts"] if p["type"] == "tool-order_status"
    ]
    assert part["state"] == "output-available" and part["input"] == {"order": "A-17"}


async def test_a_worker_killed_mid_stream_is_recovered(site: Site, session: str) -> None:
    [victim] = site.workers
    name = f"kill-{uuid.uuid4().hex[:8]}"
    async with client(site, name, session) as chat:
        await chat.send(chat_request("k1", [user_message("count to 60 [rate 25]")]))
        log = await follow_conversation(
            chat, until=lambda log: len(log.stream("k1").chunks) >= 15, timeout=30
        )
        victim.kill(signal.SIGKILL)
        site.workers.remove(victim)
        await asyncio.to_thread(site.start_worker)
        await follow_conversation(chat, log, timeout=60)
    assert len(log.order) >= 2 and log.text == numbers(60)
    for stream in log.streams.values():
        assert stream.seqs == list(range(len(stream.seqs)))
    stored = transcript(site, name, session)
    assert [m["role"] for m in stored] == ["user", "assistant"] and assistant_text(stored) == numbers(60)


def test_the_admin_and_the_health_endpoint(site: Site, session: str) -> None:
    status, body = site.get("/admin/think_chat/conversation/", session)
    assert status == 200 and b"page-" in body
    assert site.get("/admin/think_recovery/incident/", session)[0] == 200

    def healthy() -> bool:
        status, body = site.get("/ops/healthz")
        return status == 200 and json.loads(body)["status"] == "ok"

    wait_until(healthy, 30, "the host's /ops/healthz to report the beat and the worker alive")
    status, body = site.get("/ops/metrics")
    assert status == 200 and b"think_" in body
