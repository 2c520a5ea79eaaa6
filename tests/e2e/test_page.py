"""The chat page in real headless Chromium (Debian's package, driven by Playwright; no browser download)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.files import described, png
from tests.support import assistant_text, require

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PNG = png()
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
    playwright = sync_api()
    require(os.path.exists(CHROMIUM), f"no Chromium at {CHROMIUM}: apt-get install chromium")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


def sync_api() -> Any:
    """playwright.sync_api (its Python package only: the browser is Debian's Chromium)."""
    try:
        from playwright import sync_api
    except ImportError:
        require(False, "playwright is not installed: pip install -e '.[dev]'")
    return sync_api


def open_page(browser: Any, port: int, name: str) -> Any:
    page = browser.new_page()
    record_frames(page)
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


def last_text(page: Any) -> str:
    return str(
        page.evaluate(
            "(() => { const m = window.thinkChat.messages().filter(m => m.role === 'assistant');"
            " if (!m.length) return '';"
            " return m[m.length - 1].parts.filter(p => p.type === 'text').map(p => p.text).join(''); })()"
        )
    )


FRAMES_KEPT = 60


def record_frames(page: Any) -> None:
    """Keep the last frames of the page's sockets (`page.frames_seen`), for a failure to show."""
    seen: list[str] = []
    page.frames_seen = seen

    def keep(direction: str, payload: Any) -> None:
        seen.append(f"{direction} {str(payload)[:300]}")
        del seen[:-FRAMES_KEPT]

    def on_socket(socket: Any) -> None:
        socket.on("framesent", lambda payload: keep(">", payload))
        socket.on("framereceived", lambda payload: keep("<", payload))

    page.on("websocket", on_socket)


def wait_for_text(page: Any, text: str, timeout: float = 30_000) -> None:
    try:
        page.wait_for_function(
            "(t) => window.thinkChat.messages().some(m => m.role === 'assistant'"
            " && m.parts.some(p => p.type === 'text' && p.text === t))",
            arg=text,
            timeout=timeout,
        )
    except sync_api().TimeoutError:
        shown = page.evaluate("JSON.stringify(window.thinkChat.messages())")
        frames = "\n".join(getattr(page, "frames_seen", []))
        raise AssertionError(f"{text!r} never shown.\nmessages: {shown}\nlast frames:\n{frames}") from None


def test_attach_files_from_the_page_and_see_them_refused_or_answered(
    stack: Any, browser: Any, tmp_path: Path
) -> None:
    """The attach button uploads each file before the message goes: a refused one (a type not accepted,
    a file over MAX_FILE_BYTES) is shown and nothing is sent; an image reaches the model and is drawn
    in the conversation from the server, with the visitor's cookie."""
    page = open_page(browser, stack.port, f"page-files-{uuid.uuid4().hex[:8]}")
    evil, big, red = tmp_path / "evil.svg", tmp_path / "big.txt", tmp_path / "red.png"
    evil.write_text("<svg xmlns='http://www.w3.org/2000/svg' onload='alert(1)'/>")
    big.write_bytes(b"a" * 5_000_001)
    red.write_bytes(PNG)
    page.fill("#message-input", "[files]")
    for refused, says in ((evil, "'image/svg+xml' are not accepted"), (big, "larger than the 5000000 bytes")):
        page.set_input_files("#file-input", str(refused))
        page.click("#send-button")
        page.wait_for_selector("#error-banner:not([hidden])", timeout=10_000)
        assert refused.name in page.inner_text("#error-text") and says in page.inner_text("#error-text")
        assert (
            page.evaluate("window.thinkChat.messages()") == []
            and page.input_value("#message-input") == "[files]"
        )
        page.click(".attachment-remove")
        page.click("#error-dismiss")
    page.set_input_files("#file-input", str(red))
    assert page.inner_text("#attachments").startswith("red.png")
    page.click("#send-button")
    wait_for_text(page, f"Files: {described('image/png', PNG)}")
    image = page.wait_for_selector("#messages [data-role='user'] img.part-image", timeout=10_000)
    page.wait_for_function("document.querySelector('img.part-image').complete", timeout=10_000)
    assert image.evaluate("img => [img.naturalWidth, img.alt]") == [2, "red.png"], "drawn from the server"
    assert page.is_hidden("#attachments") and page.input_value("#message-input") == ""
    page.wait_for_function("window.thinkChat.status() === 'idle'", timeout=10_000)
    page.close()


def test_approve_a_tool_from_the_page(stack: Any, browser: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    page = open_page(browser, stack.port, f"tool-agent/page-{tag}")
    page.fill("#message-input", f'[tool delete_file {{"tag": "{tag}"}}]')
    page.click("#send-button")
    page.wait_for_selector("[data-state='approval-requested'] button[data-action='approve']", timeout=15_000)
    page.click("button[data-action='approve']")
    wait_for_text(page, f"Tool delete_file returned: deleted {tag}")
    page.wait_for_selector("[data-state='output-available'] .tool-name", timeout=10_000)
    assert page.inner_text("[data-state='output-available'] .tool-name") == "delete_file"
    page.close()


def test_answer_a_client_tool_from_the_page(stack: Any, browser: Any) -> None:
    page = open_page(browser, stack.port, f"tool-agent/page-{uuid.uuid4().hex[:8]}")
    page.fill("#message-input", '[tool ask_user {"question": "Your name?"}]')
    page.click("#send-button")
    page.wait_for_selector("form[data-action='answer'] input", timeout=15_000)
    page.fill("form[data-action='answer'] input", "Ada")
    page.wait_for_function("window.thinkChat.status() === 'idle'", timeout=10_000)  # the turn has ended
    assert page.input_value("form[data-action='answer'] input") == "Ada", "typing survives re-renders"
    page.click("form[data-action='answer'] button")
    wait_for_text(page, 'Tool ask_user returned: {"answer": "Ada"}')
    # The continuation has finished (and stored its message) before the test's database is flushed.
    page.wait_for_function("window.thinkChat.status() === 'idle'", timeout=10_000)
    page.close()


def test_the_browser_answers_its_automatic_client_tool(stack: Any, browser: Any) -> None:
    page = open_page(browser, stack.port, f"tool-agent/page-{uuid.uuid4().hex[:8]}")
    page.fill("#message-input", "[tool get_local_time {}]")
    page.click("#send-button")
    page.wait_for_function(
        "window.thinkChat.messages().some(m => m.parts.some(p => p.type === 'text'"
        ' && p.text.startsWith(\'Tool get_local_time returned: {"iso": "\')))',
        timeout=30_000,
    )
    page.close()


def test_clear_empties_the_page_and_the_server(stack: Any, browser: Any) -> None:
    from chat.transcript.selectors import conversation_get, messages_list

    name = f"page-{uuid.uuid4().hex[:8]}"
    page = open_page(browser, stack.port, name)
    page.fill("#message-input", "count to 3")
    page.click("#send-button")
    wait_for_text(page, "1 2 3")
    page.wait_for_function("window.thinkChat.status() === 'idle'", timeout=10_000)
    page.click("#clear-button")
    page.wait_for_function("window.thinkChat.messages().length === 0", timeout=5_000)
    conversation = conversation_get(agent="assistant", name=name)
    assert conversation is not None
    wait_until_empty = time.monotonic() + 10
    while messages_list(conversation_id=conversation.pk) and time.monotonic() < wait_until_empty:
        time.sleep(0.1)
    assert messages_list(conversation_id=conversation.pk) == []
    assert page.inner_text("#recent-list").count(name) == 1, "the conversation is in the list"
    page.close()


def test_stop_everything_settles_a_waiting_approval_and_the_button_goes(stack: Any, browser: Any) -> None:
    """A tool waits for a human: the page offers "Stop everything"; it settles the call as cancelled (in
    the page and on the server) and the conversation takes the next message."""
    tag = uuid.uuid4().hex[:8]
    page = open_page(browser, stack.port, f"tool-agent/page-stop-{tag}")
    assert page.is_hidden("#stop-all-button")
    page.fill("#message-input", f'[tool delete_file {{"tag": "{tag}"}}]')
    page.click("#send-button")
    page.wait_for_selector("[data-state='approval-requested'] button[data-action='approve']", timeout=15_000)
    page.wait_for_selector("#stop-all-button:visible", timeout=10_000)
    page.click("#stop-all-button")
    page.wait_for_selector("[data-state='output-error']", timeout=10_000)
    assert page.query_selector("button[data-action='approve']") is None
    page.wait_for_selector("#stop-all-button", state="hidden", timeout=10_000)
    from chat.transcript.selectors import conversation_get, messages_list
    from chat.transcript.stop import STOPPED_TOOL_ERROR

    conversation = conversation_get(agent="tool-agent", name=f"page-stop-{tag}")
    assert conversation is not None
    [part] = [
        p for m in messages_list(conversation_id=conversation.pk) for p in m["parts"] if "toolCallId" in p
    ]
    assert (part["state"], part["errorText"]) == ("output-error", STOPPED_TOOL_ERROR)
    page.fill("#message-input", "count to 3")
    page.click("#send-button")
    wait_for_text(page, "1 2 3")
    page.close()


def test_regenerate_keeps_the_first_answer_and_the_page_switches_between_them(
    stack: Any, browser: Any
) -> None:
    name = f"page-branch-{uuid.uuid4().hex[:8]}"
    page = open_page(browser, stack.port, f"assistant/{name}")
    page.fill("#message-input", "count to 3")
    page.click("#send-button")
    wait_for_text(page, "1 2 3")
    page.wait_for_function("window.thinkChat.status() === 'idle'", timeout=15_000)
    first = page.evaluate("() => window.thinkChat.messages()[1].id")
    page.click("button[data-regenerate]")
    page.wait_for_selector(".branch-nav .branch-label", timeout=30_000)
    assert page.inner_text(".branch-nav .branch-label") == "2/2"
    second = page.evaluate("() => window.thinkChat.messages()[1].id")
    assert second != first

    page.click(".branch-nav button[aria-label='previous version']")
    page.wait_for_function("(id) => window.thinkChat.messages()[1].id === id", arg=first, timeout=10_000)
    assert page.inner_text(".branch-nav .branch-label") == "1/2"
    from chat.transcript.selectors import conversation_get, messages_list

    conversation = conversation_get(agent="assistant", name=name)
    assert conversation is not None
    assert [m["id"] for m in messages_list(conversation_id=conversation.pk)][1] == first
    page.close()
