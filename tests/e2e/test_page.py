"""The chat page in real headless Chromium (Debian's package, driven by Playwright; no browser download)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import assistant_text

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture(scope="module", autouse=True)
def allow_sync_db_beside_playwright() -> Iterator[None]:
    """Playwright's sync API keeps an event loop in this thread, which Django's async-safety check
    mistakes for async code (microsoft/playwright-pytest#29): allow sync DB work in this module only."""
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    yield
    if previous is None:
        del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


def open_page(browser: Any, port: int, name: str) -> Any:
    page = browser.new_page()
    page.goto(f"http://127.0.0.1:{port}/#{name}")
    page.wait_for_function("window.thinkChat && window.thinkChat.status() === 'idle'", timeout=15_000)
    return page


def test_send_and_watch_the_stream(stack: Any, browser: Any) -> None:
    name = f"page-{uuid.uuid4().hex[:8]}"
    page = open_page(browser, stack.port, name)
    page.fill("#message-input", "count to 30 [rate 30]")
    page.click("#send-button")
    page.wait_for_function("window.thinkChat.status() === 'streaming'", timeout=10_000)
    page.wait_for_function("window.thinkChat.status() === 'idle'", timeout=30_000)
    messages = page.evaluate("window.thinkChat.messages()")
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert assistant_text(messages) == " ".join(str(i) for i in range(1, 31))
    bubble = page.inner_text("#messages [data-role='assistant']")
    assert "29 30" in bubble
    page.close()


def test_reload_mid_stream_resumes_through_the_handshake(stack: Any, browser: Any) -> None:
    name = f"page-{uuid.uuid4().hex[:8]}"
    page = open_page(browser, stack.port, name)
    page.fill("#message-input", "count to 60 [rate 30]")
    page.click("#send-button")
    page.wait_for_function(
        "window.thinkChat.messages().some(m => m.role === 'assistant' && m.parts.some(p => p.text))",
        timeout=10_000,
    )
    page.reload()
    deadline = time.monotonic() + 30
    page.wait_for_function("window.thinkChat && window.thinkChat.messages().length >= 2", timeout=15_000)
    page.wait_for_function(
        "window.thinkChat.status() === 'idle' && window.thinkChat.messages().length === 2",
        timeout=max(1_000, int((deadline - time.monotonic()) * 1000)),
    )
    page.wait_for_function(
        "(() => { const m = window.thinkChat.messages(); const a = m[m.length - 1];"
        " return a.parts.some(p => p.type === 'text' && p.text.endsWith(' 60')); })()",
        timeout=30_000,
    )
    messages = page.evaluate("window.thinkChat.messages()")
    assert assistant_text(messages) == " ".join(str(i) for i in range(1, 61)), (
        "nothing repeated, nothing lost"
    )
    page.close()
