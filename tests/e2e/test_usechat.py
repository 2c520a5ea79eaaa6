"""The AI SDK's own `useChat` (@ai-sdk/react 4, ai 7, React 19) over plain HTTP, in headless Chromium.

The app (tests/js/usechat) uses `DefaultChatTransport({api: "/ai/<agent>"})` with `resume: true`, as the
AI SDK documents it, unmodified. Each scenario asks that the screen, useChat's state and the store agree:
a stream, a reload mid-stream (rejoined), a worker SIGKILLed mid-stream (the live screen holds 1..N
once, with no reload), the web process killed mid-stream (the app rejoins on the disconnect), a stop,
a regenerate and an edit, a server tool, an approval, a client tool, and a turn sent over the
WebSocket seen through the HTTP rejoin.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from chat.transcript.files import file_id_of
from tests.e2e.react_hook import build_bundle, rendered, screen, settle, stored, stored_answer, wait_text
from tests.e2e.react_hook import watch_in_place as watch_call
from tests.e2e.react_hook import watch_one_answer as watch_screen
from tests.e2e.test_page import allow_sync_db_beside_playwright, browser  # noqa: F401
from tests.files import described, png
from tests.support import BIN, ChatClient, Proc, chat_request, free_port, numbers, user_message, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

AGENT = "assistant"
PNG = png()


@pytest.fixture(scope="module")
def bundle() -> Path:
    return build_bundle("usechat")


@pytest.fixture
def context(browser: Any) -> Iterator[Any]:  # noqa: F811
    context = browser.new_context()
    yield context
    context.close()


def new_name(tag: str) -> str:
    return f"usechat-{tag}-{uuid.uuid4().hex[:8]}"


def open_chat(context: Any, port: int, name: str) -> Any:
    """A tab of the app on conversation `name`, useChat mounted and its first rejoin answered."""
    base = f"http://127.0.0.1:{port}"
    if not any(c["name"] == "sessionid" for c in context.cookies(base)):
        context.request.get(f"{base}/")  # the demo gives each visitor an anonymous session
    page = context.new_page()
    page.errors, page.logs, page.requests = [], [], []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.on("console", lambda message: page.logs.append(f"{message.type}: {message.text}"))
    page.on("request", lambda request: page.requests.append(f"{request.method} {request.url[len(base) :]}"))
    page.goto(f"{base}/__usechat__/index.html#agent={AGENT}&name={name}")
    page.wait_for_function("window.chat && window.chat.ready", timeout=15_000)
    page.wait_for_function("window.chat.rejoins() > 0", timeout=15_000)  # the mount's GET answered
    page.wait_for_function("window.chat.status() === 'ready'", timeout=15_000)
    return page


def chat_messages(page: Any) -> list[dict[str, Any]]:
    return page.evaluate("window.chat.messages()")  # type: ignore[no-any-return]


def assert_agree(page: Any, name: str) -> list[dict[str, Any]]:
    """Screen, useChat and store show the same messages, in the same order, with the same ids: the
    screen is useChat's messages rendered, and those hold the stored text and tool calls (an object's
    keys in the order the model wrote them; Postgres gives them back in its own)."""
    transcript = stored(name)
    held = chat_messages(page)
    assert screen(page) == rendered(held)
    assert [essence(m) for m in held] == [essence(m) for m in transcript]
    return transcript


def essence(message: dict[str, Any]) -> tuple[Any, ...]:
    parts = [
        (p["type"], p.get("text", ""), p.get("state"), p.get("output"))
        for p in message["parts"]
        if p["type"] != "step-start"
    ]
    return message["id"], message["role"], parts


def finished(page: Any, name: str, *, answers: int = 1, timeout: float = 60) -> list[dict[str, Any]]:
    def check() -> list[dict[str, Any]]:
        transcript = stored(name)
        assert sum(m["role"] == "assistant" for m in transcript) >= answers, (transcript, page.logs[-20:])
        assert page.evaluate("window.chat.status()") == "ready"
        return assert_agree(page, name)

    return settle(check, timeout=timeout)  # type: ignore[no-any-return]


def answer_text(message: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in message["parts"] if p["type"] == "text")


def send(page: Any, text: str) -> None:
    before = page.evaluate("() => window.chat.messages().length")
    page.evaluate("text => { window.chat.send(text); }", text)
    page.wait_for_function(
        "before => window.chat.status() !== 'ready' || window.chat.messages().length > before",
        arg=before,
        polling=20,
        timeout=5_000,
    )


def test_a_streamed_answer(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("stream")
    page = open_chat(context, stack.port, name)
    send(page, "count to 30 [rate 40]")
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert answer_text(transcript[1]) == numbers(30)
    assert f"POST /ai/{AGENT}" in page.requests and f"GET /ai/{AGENT}/{name}/stream" in page.requests
    assert page.errors == [] and page.evaluate("window.chat.errors()") == []


def test_files_sent_by_usechat_reach_the_model_and_its_echo_is_not_an_edit(
    stack: Any, context: Any, bundle: Path, tmp_path: Path
) -> None:
    """`sendMessage({text, files})` with a FileList: the AI SDK sends the file as a data URL, and sends it
    again with every later request (it keeps its own copy). The server keeps one file, the model gets
    its bytes, and the echo changes nothing."""
    from chat.models import Branch, ChatFile

    name = new_name("files")
    page = open_chat(context, stack.port, name)
    (tmp_path / "red.png").write_bytes(PNG)
    page.set_input_files("#files", str(tmp_path / "red.png"))
    page.evaluate("text => { window.chat.sendFiles(text); }", "[files]")
    transcript = finished(page, name)
    assert answer_text(transcript[1]) == f"Files: {described('image/png', PNG)}"
    [kept] = [p for p in transcript[0]["parts"] if p["type"] == "file"]
    [held] = [p for p in chat_messages(page)[0]["parts"] if p["type"] == "file"]
    assert file_id_of(kept["url"]) is not None and held["url"].startswith("data:image/png;base64,")
    send(page, "count to 3")
    transcript = finished(page, name, answers=2)
    assert [m["role"] for m in transcript] == ["user", "assistant", "user", "assistant"]
    assert answer_text(transcript[3]) == numbers(3)
    assert not Branch.objects.filter(conversation__name=name).exists(), "the echo was not an edit"
    assert ChatFile.objects.filter(conversation__name=name).count() == 1
    assert page.errors == [] and page.evaluate("window.chat.errors()") == []


def test_a_reload_mid_stream_rejoins_the_answer(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("reload")
    page = open_chat(context, stack.port, name)
    send(page, "count to 80 [rate 30]")
    wait_text(page, " 12 ")
    page.reload()
    page.wait_for_function("window.chat && window.chat.ready", timeout=15_000)
    wait_text(page, " 40 ")  # the rejoin's replay and live tail, in the reloaded tab
    watch_one_answer(page, numbers(80))
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert answer_text(transcript[1]) == numbers(80)


@pytest.fixture
def own_workers(recovery_stack: Any) -> Iterator[Any]:
    yield recovery_stack
    recovery_stack.stop_workers()


def test_a_worker_killed_mid_stream_leaves_one_answer_on_the_live_screen(
    own_workers: Any, context: Any, bundle: Path
) -> None:
    stack = own_workers
    worker = stack.start_worker()
    name = new_name("kill")
    page = open_chat(context, stack.port, name)
    send(page, "count to 150 [rate 40]")
    wait_text(page, " 30 ")
    worker.kill(signal.SIGKILL)
    stack.start_worker()
    watch_one_answer(page, numbers(150))  # the same response, no reload, no rejoin
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert answer_text(transcript[1]) == numbers(150)
    assert page.requests.count(f"GET /ai/{AGENT}/{name}/stream") == 1, "only the mount's rejoin"


def test_the_web_process_killed_mid_stream_is_rejoined(stack: Any, context: Any, bundle: Path) -> None:
    """A web process of its own dies mid-answer (SIGKILL) and comes back on the same address: the app
    hears a disconnect and rejoins (resumeStream), and the screen holds 1..N once."""
    port = free_port()
    web = start_web(stack, port)
    name = new_name("web")
    page = open_chat(context, port, name)
    try:
        send(page, "count to 120 [rate 30]")
        wait_text(page, " 15 ")
        web.kill(signal.SIGKILL)
        web = start_web(stack, port)
        watch_one_answer(page, numbers(120))
        transcript = finished(page, name)
    finally:
        web.stop()
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert answer_text(transcript[1]) == numbers(120)
    assert any(f["isDisconnect"] for f in page.evaluate("window.chat.finishes()"))


def start_web(stack: Any, port: int) -> Proc:
    args = [str(BIN / "daphne"), "-b", "127.0.0.1", "-p", str(port), "thinkproject.asgi:application"]
    proc = Proc(
        "daphne", args, stack.env, stack.log_dir / f"daphne-{port}-{uuid.uuid4().hex[:4]}.log"
    ).start()

    def listening() -> bool:
        import socket

        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, 30, "daphne to listen")
    return proc


def test_stop_leaves_the_screen_equal_to_the_store_and_a_later_turn_keeps_it(
    stack: Any, context: Any, bundle: Path
) -> None:
    name = new_name("stop")
    page = open_chat(context, stack.port, name)
    send(page, "count to 200 [rate 20]")
    wait_text(page, " 20 ")
    page.click("#stop")
    transcript = finished(page, name)
    stopped = answer_text(transcript[1])
    assert numbers(200).startswith(stopped) and 20 <= len(stopped.split()) < 200
    assert f"POST /ai/{AGENT}/{name}/stop" in page.requests
    first = screen(page)[1]
    send(page, "count to 5")
    transcript = finished(page, name, answers=2)
    assert screen(page)[1] == first, "the next turn leaves the stopped answer alone"
    assert answer_text(transcript[3]) == numbers(5)


def test_regenerate_and_edit_replace_the_answer(stack: Any, context: Any, bundle: Path) -> None:
    """useChat's regenerate() and its edit (sendMessage with a messageId) go out as the trigger and
    messageId of a POST; the store keeps what they replace as branches, and agrees with the screen."""
    from chat.models import Branch

    name = new_name("regen")
    page = open_chat(context, stack.port, name)
    send(page, "count to 6")
    first = finished(page, name)
    page.evaluate("() => { window.chat.regenerate(); }")
    page.wait_for_function("window.chat.status() !== 'ready'", polling=20, timeout=5_000)

    def regenerated() -> list[dict[str, Any]]:
        transcript = finished(page, name)
        assert transcript[1]["id"] != first[1]["id"]
        return transcript

    transcript = settle(regenerated, timeout=30)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert answer_text(transcript[1]) == numbers(6)

    def edited() -> list[dict[str, Any]]:
        transcript = finished(page, name)
        assert [answer_text(m) for m in transcript] == ["count to 4", numbers(4)]
        return transcript

    page.evaluate("([id, text]) => { window.chat.edit(id, text); }", [first[0]["id"], "count to 4"])
    transcript = settle(edited, timeout=30)
    assert transcript[0]["id"] == first[0]["id"], "the edited question keeps its id"
    assert Branch.objects.filter(conversation__name=name).count() == 2


def test_a_turn_sent_over_the_websocket_is_seen_through_the_http_rejoin(
    stack: Any, context: Any, bundle: Path
) -> None:
    """The visitor's other client (its session, over the WebSocket) starts a turn; the useChat page
    opened meanwhile rejoins it over HTTP on mount and shows it whole."""
    name = new_name("ws")
    base = f"http://127.0.0.1:{stack.port}"
    context.request.get(f"{base}/")
    session = next(c["value"] for c in context.cookies(base) if c["name"] == "sessionid")

    async def send_over_socket() -> None:
        async with ChatClient(stack.port, name, principal=None, cookie=f"sessionid={session}") as client:
            await client.recv_type("cf_agent_identity")
            await client.send(chat_request("ws-1", [user_message("count to 100 [rate 30]")]))
            await client.recv_type("cf_agent_use_chat_response")

    with ThreadPoolExecutor(1) as pool:  # Playwright's sync API holds this thread's event loop
        pool.submit(asyncio.run, send_over_socket()).result(timeout=30)
    page = open_chat(context, stack.port, name)
    watch_one_answer(page, numbers(100))
    transcript = finished(page, name)
    assert answer_text(transcript[1]) == numbers(100)


STATE = "({status: chat.status(), errors: chat.errors(), finishes: chat.finishes()})"


def watch_one_answer(page: Any, expected: str, timeout: float = 60) -> None:
    watch_screen(page, expected, timeout, state=STATE)


def watch_in_place(page: Any, tool: str, last: str, timeout: float = 60) -> None:
    watch_call(page, tool, last, timeout, state=STATE)


def test_a_server_tool_streams_its_input_and_output(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("tool")
    page = open_chat(context, stack.port, name)
    send(page, '[tool get_weather {"city": "Paris"}]')
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    [tool] = [p for p in transcript[1]["parts"] if p["type"] == "tool-get_weather"]
    assert tool["state"] == "output-available" and tool["output"]["city"] == "Paris"
    assert answer_text(transcript[1]).startswith("Tool get_weather returned:")


def test_an_approval_continues_in_the_same_message(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("approve")
    page = open_chat(context, stack.port, name)
    send(page, '[tool send_email {"to": "a@b.c", "subject": "hi"}] count to 40 [rate 30]')
    page.wait_for_selector("button.approve", timeout=30_000)
    asked = settle(lambda: stored_answer(name))  # the request shows before the turn stores its message
    page.click("button.approve")
    watch_in_place(page, "send_email", " 40")
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert transcript[1]["id"] == asked[1]["id"], "the continuation extended the asking message"
    [tool] = [p for p in transcript[1]["parts"] if p["type"] == "tool-send_email"]
    assert tool["state"] == "output-available" and "queued" in tool["output"]
    assert answer_text(transcript[1]).startswith("Tool send_email returned:")
    assert page.requests.count(f"POST /ai/{AGENT}") == 2, "the approval went back in a POST of its own"


def test_a_client_tool_answered_through_on_tool_call(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("client")
    page = open_chat(context, stack.port, name)
    send(page, "[tool get_local_time {}] count to 40 [rate 30]")
    watch_in_place(page, "get_local_time", " 40")
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    [tool] = [p for p in transcript[1]["parts"] if p["type"] == "tool-get_local_time"]
    assert tool["state"] == "output-available" and tool["output"] == {"time": "12:34"}
    assert answer_text(transcript[1]) == 'Tool get_local_time returned: {"time": "12:34"}' + " " + numbers(40)
