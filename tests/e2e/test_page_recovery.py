"""The page while its worker is killed mid-stream: the recovering state shows, then the whole answer."""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

import pytest

from tests.e2e.test_page import allow_sync_db_beside_playwright, browser, open_page  # noqa: F401
from tests.support import assistant_text, numbers

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def own_workers(recovery_stack: Any) -> Any:
    yield
    recovery_stack.stop_workers()


def test_the_page_shows_a_recovery_after_the_worker_is_killed(recovery_stack: Any, browser: Any) -> None:  # noqa: F811
    worker = recovery_stack.start_worker()
    page = open_page(browser, recovery_stack.port, f"page-{uuid.uuid4().hex[:8]}")
    page.evaluate(
        "window.__sawRecovering = false;"
        " setInterval(() => { if (!document.getElementById('recovering-badge').hidden)"
        " window.__sawRecovering = true; }, 50);"
    )
    page.fill("#message-input", "count to 60 [rate 20]")
    page.click("#send-button")
    page.wait_for_function(
        "window.thinkChat.messages().some(m => m.role === 'assistant'"
        " && m.parts.some(p => p.text && p.text.includes(' 8')))",
        timeout=20_000,
    )
    worker.kill(signal.SIGKILL)
    recovery_stack.start_worker()
    page.wait_for_function("window.__sawRecovering === true", timeout=30_000)
    page.wait_for_function(
        "window.thinkChat.status() === 'idle' && window.thinkChat.messages().some(m => m.role === 'assistant'"
        " && m.parts.some(p => p.type === 'text' && p.text.endsWith(' 60')))",
        timeout=60_000,
    )
    assert page.is_hidden("#recovering-badge")
    assert assistant_text(page.evaluate("window.thinkChat.messages()")) == numbers(60)
    page.close()


def test_the_page_shows_a_turn_queued_until_its_first_chunk(recovery_stack: Any, browser: Any) -> None:  # noqa: F811
    """No worker is up when the page sends: the server says the turn waits (cf_agent_chat_queued) and
    the page shows "queued…"; once a worker starts and the first chunk arrives, it streams."""
    page = open_page(browser, recovery_stack.port, f"page-{uuid.uuid4().hex[:8]}")
    # Every status label the page shows, with whether the answer had begun to show at that moment: both
    # read off the screen (the state runs a frame ahead of the rendering, which happens on the next
    # animation frame).
    page.evaluate(
        "window.__labels = [];"
        " setInterval(() => { const text = [...document.querySelectorAll('.message-assistant')]"
        ".some(m => /[0-9]/.test(m.textContent)); window.__labels.push([document.getElementById('status')"
        ".textContent, text]); }, 20);"
    )
    page.fill("#message-input", "count to 20 [rate 20]")
    page.click("#send-button")
    page.wait_for_function(
        "document.getElementById('status').textContent.startsWith('queued')", timeout=10_000
    )
    assert page.evaluate("window.thinkChat.state.queued.reason") == "workers"
    time.sleep(1.0)  # it stays queued while nothing can take it
    assert page.inner_text("#status").startswith("queued")
    recovery_stack.start_worker()
    page.wait_for_function(
        "window.thinkChat.status() === 'idle' && window.thinkChat.messages().some(m => m.role === 'assistant'"
        " && m.parts.some(p => p.type === 'text' && p.text.endsWith(' 20')))",
        timeout=60_000,
    )
    labels = page.evaluate("window.__labels")
    assert not [label for label, text in labels if text and label.startswith("queued")], (
        "the queued status ends with the first chunk"
    )
    shown = [label for label, _ in labels]
    assert "streaming…" in shown[shown.index(next(lb for lb in shown if lb.startswith("queued"))) :]
    assert assistant_text(page.evaluate("window.thinkChat.messages()")) == numbers(20)
    page.close()
