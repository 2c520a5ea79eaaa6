"""The published React hook (`useAgentChat`, agents@0.32.0, ai@7, React 19) in headless Chromium.

Each scenario asks that the screen, the hook's state and the store agree: a plain stream, a reload
mid-stream, a worker killed mid-stream (the live screen holds the answer once, with no reload), a stop
(the screen shows what is stored, and a later turn never changes it), a server tool, an approval, a
client tool, and two tabs on one conversation, also on two web processes across a worker's SIGKILL.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.react_hook import (
    build_bundle,
    hook_messages,
    new_tab,
    rendered,
    screen,
    settle,
    stored,
    stored_answer,
    wait_idle,
    wait_text,
    watch_in_place,
    watch_one_answer,
    watch_one_answer_in,
)
from tests.e2e.test_page import allow_sync_db_beside_playwright, browser  # noqa: F401
from tests.support import numbers, start_daphne

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

AGENT = "assistant"


@pytest.fixture(scope="module")
def bundle() -> Path:
    return build_bundle()


@pytest.fixture
def context(browser: Any) -> Iterator[Any]:  # noqa: F811
    context = browser.new_context()
    yield context
    context.close()


def new_name(tag: str) -> str:
    return f"hook-{tag}-{uuid.uuid4().hex[:8]}"


def assert_agree(page: Any, name: str) -> list[dict[str, Any]]:
    """Screen, hook and store show the same messages, in the same order, with the same ids."""
    transcript = stored(name)
    assert screen(page) == rendered(transcript)
    assert [(m["id"], m["role"]) for m in hook_messages(page)] == [(m["id"], m["role"]) for m in transcript]
    return transcript


def finished(page: Any, name: str, *, answers: int = 1, timeout: float = 60) -> list[dict[str, Any]]:
    """Wait for `answers` assistant messages to be stored and for the page to agree with them."""

    def check() -> list[dict[str, Any]]:
        transcript = stored(name)
        assert sum(m["role"] == "assistant" for m in transcript) >= answers, (transcript, page.logs[-20:])
        wait_idle(page, 5_000)
        return assert_agree(page, name)

    return settle(check, timeout=timeout)  # type: ignore[no-any-return]


def answer_text(message: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in message["parts"] if p["type"] == "text")


def send(page: Any, text: str) -> None:
    """Send a message as the input would; returns once the hook took it (sendMessage's promise ends
    with the turn). A short turn can be over before a poll sees the hook busy, so the user message
    showing counts as taken too; polled on a timer, which a background tab still runs."""
    before = page.evaluate("() => window.hook.messages().length")
    page.evaluate("text => { window.hook.send(text); }", text)
    page.wait_for_function(
        "before => window.hook.status() !== 'ready' || window.hook.messages().length > before",
        arg=before,
        polling=20,
        timeout=5_000,
    )


def test_a_streamed_answer(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("stream")
    page = new_tab(context, stack.port, AGENT, name)
    send(page, "count to 30 [rate 40]")
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert answer_text(transcript[1]) == numbers(30)
    assert page.errors == []


def test_a_reload_mid_stream_shows_the_answer_once(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("reload")
    page = new_tab(context, stack.port, AGENT, name)
    send(page, "count to 80 [rate 30]")
    wait_text(page, " 12 ")
    page.reload()
    page.wait_for_function("window.hook && window.hook.ready", timeout=15_000)
    wait_text(page, " 40 ")  # the replay and the live tail, in the reloaded tab
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
    page = new_tab(context, stack.port, AGENT, name)
    send(page, "count to 200 [rate 40]")
    wait_text(page, " 40 ")
    worker.kill(signal.SIGKILL)
    stack.start_worker()
    # Watch the live screen (no reload) until the answer is whole: never a second copy, never a gap.
    expected = numbers(200)
    watch_one_answer(page, expected)
    assert [f for f in page.received if f["type"] == "cf_agent_chat_recovering" and f["recovering"]]
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert answer_text(transcript[1]) == expected


def test_tabs_on_two_web_processes_see_one_exact_answer_across_a_worker_kill(
    own_workers: Any, context: Any, bundle: Path, log_dir: Path
) -> None:
    """Two web processes serve one site (behind a balancer, each tab on one of them): the conversation's
    fan-out (the channel layer) and its store are shared, so a tab on each follows the same answer live,
    once and without a gap, across a SIGKILL of the worker mid-stream (docs/operations.md). The second
    process's tab gets it live: with a channel layer of its own it would see nothing for ten minutes."""
    stack = own_workers
    # The other process never reads a silent stream from Postgres: what its tab shows came live.
    other_web, other_port = start_daphne({**stack.env, "THINK_TEST_STREAM_SILENCE_MS": "600000"}, log_dir)
    try:
        worker = stack.start_worker()
        name = new_name("two-webs")
        first = new_tab(context, stack.port, AGENT, name)
        second = new_tab(context, other_port, AGENT, name)
        send(first, "count to 120 [rate 40]")
        wait_text(second, " 30 ")  # live on the other web process
        worker.kill(signal.SIGKILL)
        stack.start_worker()
        expected = numbers(120)
        watch_one_answer_in([first, second], expected)
        transcript = finished(first, name)
        assert [m["role"] for m in transcript] == ["user", "assistant"]
        assert answer_text(transcript[1]) == expected
        settle(lambda: assert_agree(second, name))
        assert first.errors == [] and second.errors == []
    finally:
        other_web.stop()


def test_a_reload_during_a_recovered_continuation_shows_the_answer_once(
    own_workers: Any, context: Any, bundle: Path
) -> None:
    """The reloaded tab gets the stored partial from get-messages and the continuation by the resume
    handshake; the replay is the whole message, so the hook shows one answer in place."""
    stack = own_workers
    worker = stack.start_worker()
    name = new_name("reload-recovered")
    page = new_tab(context, stack.port, AGENT, name)
    send(page, "count to 150 [rate 30]")
    wait_text(page, " 20 ")
    worker.kill(signal.SIGKILL)
    stack.start_worker()
    wait_text(page, " 60 ", 60_000)  # the continuation is streaming
    page.reload()
    page.wait_for_function("window.hook && window.hook.ready", timeout=15_000)
    watch_one_answer(page, numbers(150))
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert answer_text(transcript[1]) == numbers(150)


def test_stop_leaves_the_screen_equal_to_the_store_and_a_later_turn_keeps_it(
    stack: Any, context: Any, bundle: Path
) -> None:
    name = new_name("stop")
    page = new_tab(context, stack.port, AGENT, name)
    other = new_tab(context, stack.port, AGENT, name)  # a second tab watches
    send(page, "count to 200 [rate 20]")
    wait_text(page, " 20 ")
    page.click("#stop")
    transcript = finished(page, name)
    assert [f for f in page.sent if f["type"] == "cf_agent_chat_request_cancel"], page.sent
    settle(lambda: assert_agree(other, name))
    stopped = answer_text(transcript[1])
    assert expected_prefix(stopped, 200) and 20 <= len(stopped.split()) < 200
    first = screen(page)[1]

    send(page, "count to 5")
    transcript = finished(page, name, answers=2)
    assert answer_text(transcript[3]) == numbers(5)
    assert screen(page)[1] == first, "a later turn never changes an earlier answer"
    assert answer_text(transcript[1]) == stopped
    settle(lambda: assert_agree(other, name))


def test_a_stop_of_everything_from_elsewhere_leaves_the_hook_ready_and_equal_to_the_store(
    stack: Any, context: Any, bundle: Path
) -> None:
    """Stop everything comes from outside the hook (server code, as the admin action and the command do
    it): the hook's stream ends, it is ready again, its screen equals the store, and it sends on."""
    from chat.agents import open_agent

    name = new_name("stopall")
    page = new_tab(context, stack.port, AGENT, name)
    send(page, "count to 400 [rate 40]")
    wait_text(page, " 10 ")
    report = open_agent(AGENT, name).stop_conversation()
    assert len(report.streams) == 1
    transcript = finished(page, name)
    stopped = answer_text(transcript[1])
    assert expected_prefix(stopped, 400) and 10 <= len(stopped.split()) < 400

    send(page, "count to 5")
    transcript = finished(page, name, answers=2)
    assert answer_text(transcript[3]) == numbers(5)
    assert answer_text(transcript[1]) == stopped


def test_regenerate_and_edit_keep_branches_and_a_switch_reaches_the_hook(
    stack: Any, context: Any, bundle: Path
) -> None:
    """The hook's own regenerate() and edit (sendMessage with a messageId) keep what they replace as
    branches; a switch made elsewhere shows in the hook as the transcript it is sent."""
    from chat.agents import open_agent
    from chat.models import Branch
    from chat.transcript.branches import BRANCH_KEY

    name = new_name("branches")
    page = new_tab(context, stack.port, AGENT, name)
    send(page, "count to 3")
    first = finished(page, name)

    def regenerated() -> None:
        transcript = stored(name)
        assert len(transcript) == 2 and transcript[1]["id"] != first[1]["id"]
        shown = hook_messages(page)  # the hook drops the old answer before the new one streams in
        assert len(shown) == 2, shown
        assert (shown[1].get("metadata") or {}).get(BRANCH_KEY) == {
            "anchorId": first[0]["id"],
            "index": 1,
            "count": 2,
        }

    page.evaluate("() => { window.hook.regenerate(); }")
    settle(regenerated, timeout=30)
    settled_regeneration = transcript = finished(page, name)
    assert answer_text(transcript[1]) == "1 2 3"

    def edited() -> None:
        assert [answer_text(m) for m in stored(name)] == ["count to 4", "1 2 3 4"]

    page.evaluate("([id, text]) => { window.hook.edit(id, text); }", [first[0]["id"], "count to 4"])
    settle(edited, timeout=30)
    transcript = finished(page, name)
    assert [answer_text(m) for m in transcript] == ["count to 4", "1 2 3 4"]
    assert Branch.objects.filter(conversation__name=name).count() == 2

    regenerated_id = settled_regeneration[1]["id"]
    conversation = open_agent(AGENT, name)
    assert conversation.switch_branch("", 0)  # the question before its edit, with the branch it had
    settle(lambda: assert_agree(page, name))
    assert [answer_text(m) for m in stored(name)] == ["count to 3", "1 2 3"]
    assert stored(name)[1]["id"] == regenerated_id, "the answer in use when the question was edited"
    assert conversation.switch_branch(first[0]["id"], 0)  # and under it, the first answer
    settle(lambda: assert_agree(page, name))
    assert stored(name)[1]["id"] == first[1]["id"]


def expected_prefix(text: str, n: int) -> bool:
    return numbers(n).startswith(text)


def test_a_server_tool(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("tool")
    page = new_tab(context, stack.port, AGENT, name)
    send(page, '[tool get_weather {"city": "Paris"}]')
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    [tool] = [p for p in transcript[1]["parts"] if p["type"] == "tool-get_weather"]
    assert tool["state"] == "output-available" and tool["output"]["city"] == "Paris"
    assert answer_text(transcript[1]).startswith("Tool get_weather returned:")


def test_an_approval_continues_in_the_same_message(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("approve")
    page = new_tab(context, stack.port, AGENT, name)
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


def test_a_client_tool_answered_by_the_hook(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("client")
    page = new_tab(context, stack.port, AGENT, name)
    send(page, "[tool get_local_time {}] count to 40 [rate 30]")
    watch_in_place(page, "get_local_time", " 40")
    transcript = finished(page, name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    [tool] = [p for p in transcript[1]["parts"] if p["type"] == "tool-get_local_time"]
    assert tool["state"] == "output-available" and tool["output"] == {"time": "12:34"}
    assert answer_text(transcript[1]) == 'Tool get_local_time returned: {"time": "12:34"}' + " " + numbers(40)


def test_two_tabs_follow_one_conversation(stack: Any, context: Any, bundle: Path) -> None:
    name = new_name("tabs")
    first = new_tab(context, stack.port, AGENT, name)
    second = new_tab(context, stack.port, AGENT, name)
    send(first, "count to 40 [rate 30]")
    wait_text(second, " 10 ")  # the second tab watches the stream live
    transcript = finished(first, name)
    settle(lambda: assert_agree(second, name))
    send(second, "count to 3")
    transcript = finished(second, name, answers=2)
    settle(lambda: assert_agree(first, name))
    assert [answer_text(m) for m in transcript if m["role"] == "assistant"] == [numbers(40), numbers(3)]
