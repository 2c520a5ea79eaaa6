"""The published React hook in Chromium: tests/js/hook/app.jsx (and the useChat app, tests/js/usechat),
built with esbuild from the locked packages (tests/js) and served by the test server itself at
/__hook__/ and /__usechat__/ (tests/urls.py), so the socket, the HTTP requests and get-messages carry
the visitor's session cookie as in any site that serves its own app.

What a person sees is read from the page (`screen`); what the hook holds, from `window.hook`; what the
server stored, from Postgres. The tests ask that all three agree.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.e2e.js_client import JS_DIR, node_with_packages
from tests.hook_paths import HOOK_DIST, USECHAT_DIST


@functools.cache
def build_bundle(app: str = "hook") -> Path:
    """Bundle tests/js/<app>/app.jsx into its dist (a fraction of a second); fails, never skips, when it
    breaks. `app`: "hook" (the agents hook) or "usechat" (the AI SDK's useChat over HTTP)."""
    node_with_packages()
    esbuild = JS_DIR / "node_modules" / ".bin" / "esbuild"
    source, dist = JS_DIR / app, {"hook": HOOK_DIST, "usechat": USECHAT_DIST}[app]
    dist.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dist.parent) as scratch:
        result = subprocess.run(
            [
                str(esbuild),
                str(source / "app.jsx"),
                "--bundle",
                "--format=iife",
                "--platform=browser",
                "--jsx=automatic",
                '--define:process.env.NODE_ENV="production"',
                "--log-level=warning",
                f"--outfile={Path(scratch) / 'app.js'}",
            ],
            cwd=JS_DIR,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"esbuild failed:\n{result.stdout}\n{result.stderr}"
        (Path(scratch) / "index.html").write_text((source / "index.html").read_text())
        for name in ("app.js", "index.html"):  # whole files only, even with another run beside this one
            os.replace(Path(scratch) / name, dist / name)
    return dist


def new_tab(context: Any, port: int, agent: str, name: str) -> Any:
    """A tab of the app on conversation `agent/name`, its hook mounted and its first probe answered."""
    base = f"http://127.0.0.1:{port}"
    if not any(c["name"] == "sessionid" for c in context.cookies(base)):
        context.request.get(f"{base}/")  # the demo gives each visitor an anonymous session
    page = context.new_page()
    errors: list[str] = []
    logs: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda message: logs.append(f"{message.type}: {message.text}"))
    sent: list[dict[str, Any]] = []
    received: list[dict[str, Any]] = []

    def on_socket(socket: Any) -> None:
        socket.on("framesent", lambda payload: sent.append(_frame(payload)))
        socket.on("framereceived", lambda payload: received.append(_frame(payload)))

    page.on("websocket", on_socket)
    page.errors, page.logs, page.sent, page.received = errors, logs, sent, received
    page.goto(f"{base}/__hook__/index.html#agent={agent}&name={name}")
    page.wait_for_function("window.hook && window.hook.ready", timeout=15_000)
    page.wait_for_function("window.hook.status() === 'ready'", timeout=15_000)
    return page


def _frame(payload: Any) -> dict[str, Any]:
    try:
        frame = json.loads(payload)
    except (TypeError, ValueError):
        return {"type": "<not json>"}
    return frame if isinstance(frame, dict) else {"type": "<not an object>"}


def screen(page: Any) -> list[dict[str, str]]:
    """The messages as rendered: role, id and the text of each bubble."""
    return page.eval_on_selector_all(  # type: ignore[no-any-return]
        "#messages .message",
        "els => els.map(e => ({role: e.dataset.role, id: e.dataset.id, text: e.innerText}))",
    )


def part_text(part: dict[str, Any]) -> str:
    """What app.jsx renders for a part (the same rules, to compare a stored message with the screen)."""
    kind = part["type"]
    if kind in ("text", "reasoning"):
        return str(part.get("text", ""))
    if kind == "step-start":
        return ""
    if kind.startswith("tool-") or kind == "dynamic-tool":
        name = part.get("toolName") if kind == "dynamic-tool" else kind[5:]
        output = (
            ""
            if "output" not in part
            else " " + json.dumps(part["output"], separators=(",", ":"), ensure_ascii=False)
        )
        return f"[{name} {part.get('state')}{output}]"
    return f"[{kind}]"


def rendered(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """How app.jsx shows a stored transcript."""
    return [
        {"role": m["role"], "id": m["id"], "text": "".join(part_text(p) for p in m["parts"])}
        for m in messages
    ]


def hook_messages(page: Any) -> list[dict[str, Any]]:
    return page.evaluate("window.hook.messages()")  # type: ignore[no-any-return]


def wait_idle(page: Any, timeout_ms: int = 60_000) -> None:
    """The hook is ready and no stream, its own or observed, is going on."""
    page.wait_for_function(
        "window.hook.status() === 'ready' && !window.hook.isServerStreaming()", timeout=timeout_ms
    )


def wait_text(page: Any, needle: str, timeout_ms: int = 30_000) -> None:
    page.wait_for_function(
        "needle => [...document.querySelectorAll('#messages .message[data-role=assistant]')]"
        ".some(e => e.innerText.includes(needle))",
        arg=needle,
        timeout=timeout_ms,
    )


def settle(check: Any, timeout: float = 10, interval: float = 0.1) -> Any:
    """Poll `check` until it returns without an AssertionError (the last one is raised)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(interval)


def stored(name: str, agent: str = "assistant") -> list[dict[str, Any]]:
    """The conversation's stored transcript (empty when it does not exist)."""
    from chat.transcript.selectors import conversation_get, messages_list

    conversation = conversation_get(agent=agent, name=name)
    return [] if conversation is None else messages_list(conversation_id=conversation.pk)


def stored_answer(name: str, agent: str = "assistant") -> list[dict[str, Any]]:
    """The stored transcript once it holds the answer to its first message (for `settle`)."""
    transcript = stored(name, agent)
    assert [m["role"] for m in transcript] == ["user", "assistant"], transcript
    return transcript


def watch_one_answer(page: Any, expected: str, timeout: float = 90, *, state: str = "null") -> None:
    """Poll the live screen until it shows `expected`: never a second copy, never a gap. `state`, a JS
    expression, says what the app holds when it does not finish (in the failure's message)."""
    watch_one_answer_in([page], expected, timeout, state=state)


def watch_one_answer_in(pages: list[Any], expected: str, timeout: float = 90, *, state: str = "null") -> None:
    """watch_one_answer on every tab at once, each polled in turn until all show `expected`."""
    deadline = time.monotonic() + timeout
    waiting = list(pages)
    while waiting:
        for page in list(waiting):
            shown = [m for m in screen(page) if m["role"] == "assistant"]
            assert len(shown) <= 1, f"the answer shows more than once: {shown}"
            text = shown[0]["text"] if shown else ""
            assert expected.startswith(text), f"the screen is not a prefix of the answer: {text[-80:]!r}"
            if text == expected:
                waiting.remove(page)
            elif time.monotonic() > deadline:
                raise AssertionError(f"the answer did not finish: {text[-80:]!r}; {page.evaluate(state)}")
        time.sleep(0.05)


def watch_in_place(page: Any, tool: str, last: str, timeout: float = 60, *, state: str = "null") -> None:
    """While a tool continuation streams, the screen shows one answer holding the call once."""
    deadline = time.monotonic() + timeout
    while True:
        shown = [m for m in screen(page) if m["role"] == "assistant"]
        assert len(shown) <= 1, f"the continuation shows as a message of its own: {shown}"
        text = shown[0]["text"] if shown else ""
        assert text.count(f"[{tool} ") <= 1, f"the call shows twice: {text[:160]!r}"
        if text.endswith(last):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the continuation did not finish: {text[-80:]!r}; {page.evaluate(state)}")
        time.sleep(0.05)
