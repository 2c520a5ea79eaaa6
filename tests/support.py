"""Helpers for tests that run the real stack: processes, a WebSocket chat client, bounded waits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests import forkserver
from tests.forkserver import Forked

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Whether start_worker forks workers from the fork server (tests/conftest.py turns it on for the suite).
FORK_WORKERS = False


def require(available: bool, what: str) -> None:
    """Skip a test whose runtime (Node.js, Chromium, Playwright) is missing on a developer's machine;
    under CI (CI=true, as .ci/run sets it) fail instead, so a suite can never pass by not running."""
    if available:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what} (CI=true: a suite that cannot run fails)", pytrace=False)
    pytest.skip(what)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], Any], timeout: float, message: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


def ticks_pass(count: int = 2, timeout: float = 20) -> None:
    """Wait until the recovery tick has run `count` more times (each run stamps the cache as it starts:
    recovery.observe.heartbeat): whatever a tick would have done about the state of now, it has
    started by then.
    A test that checks that something did not happen waits for this, not for a fixed time."""
    from recovery.observe.heartbeat import beat_last_tick

    last, seen = beat_last_tick(), 0

    def advanced() -> bool:
        nonlocal last, seen
        stamp = beat_last_tick()
        if stamp != last:
            last, seen = stamp, seen + 1
        return seen >= count

    wait_until(advanced, timeout, f"{count} recovery ticks")


def wait_logged(proc: Proc, text: str, timeout: float = 20) -> None:
    """Wait until `proc` has logged `text` (the event that shows a moment has passed)."""
    wait_until(lambda: text in proc.log(), timeout, f"{proc.name} to log {text!r}")


@dataclass
class Proc:
    """A child process whose output goes to a log file, killed (whole group) at the end."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | Forked | None = None
    hostname: str = ""  # a Celery worker's node name

    def start(self) -> Proc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.popen = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def fork(self) -> Proc:
        """Start a `celery` command from the test runner's fork server (tests/forkserver.py)."""
        self.popen = forkserver.server(self.env).fork(self.args, self.env, self.log_path, ROOT)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)

    def signal(self, sig: int) -> None:
        """Send a signal to the process group without waiting (SIGSTOP, SIGCONT, SIGTERM)."""
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.signal(signal.SIGCONT)
        self.kill(signal.SIGTERM)
        self.kill(signal.SIGKILL)


def stack_env(*, database_name: str, model_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        THINK_TEST_DATABASE_NAME=database_name,
        SCRIPTED_MODEL_URL=model_url,
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_worker(
    env: dict[str, str],
    log_dir: Path,
    *,
    name: str = "worker",
    pool: str = "threads",
    concurrency: int = 8,
    app: str = "thinkproject",
    queues: str | None = None,
    forked: bool | None = None,
) -> Proc:
    """A Celery worker, once it says it is ready. `queues`: what it consumes (-Q), else its app's
    default queue; its node name is kept on the Proc (`hostname`) for remote control. `forked`: from
    the fork server (FORK_WORKERS by default: the test suite's choice; benchmarks exec theirs)."""
    hostname = f"{name}-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
    args = [
        str(BIN / "celery"),
        "-A",
        app,
        "worker",
        "--pool",
        pool,
        "--concurrency",
        str(concurrency),
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "info",
        "-n",
        hostname,
        *(["-Q", queues] if queues else []),
    ]
    proc = Proc(name, args, env, log_dir / f"{hostname.split('@')[0]}.log", hostname=hostname)
    if FORK_WORKERS if forked is None else forked:
        proc.fork()
    else:
        proc.start()
    wait_until(lambda: " ready." in proc.log() or proc.popen.poll() is not None, 60, f"{name} to start")  # type: ignore[union-attr]
    assert proc.popen is not None and proc.popen.poll() is None, proc.log()
    return proc


def start_daphne(
    env: dict[str, str],
    log_dir: Path,
    *,
    application: str = "thinkproject.asgi:application",
    options: tuple[str, ...] = (),
) -> tuple[Proc, int]:
    port = free_port()
    args = [str(BIN / "daphne"), "-b", "127.0.0.1", "-p", str(port), *options, application]
    return start_listening("daphne", args, env, log_dir / f"daphne-{port}.log", port), port


def start_listening(name: str, args: list[str], env: dict[str, str], log_path: Path, port: int) -> Proc:
    """A server process, once it accepts connections on `port`."""
    proc = Proc(name, args, env, log_path).start()

    def listening() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, 30, f"{name} to listen")
    return proc


def chat_request(request_id: str, messages: list[dict[str, Any]], **extra: Any) -> str:
    body = {"messages": messages, "trigger": "submit-message", **extra}
    return json.dumps(
        {
            "type": "cf_agent_use_chat_request",
            "id": request_id,
            "init": {"method": "POST", "body": json.dumps(body)},
        }
    )


def user_message(text: str, message_id: str | None = None) -> dict[str, Any]:
    return {
        "id": message_id or f"u-{uuid.uuid4().hex[:8]}",
        "role": "user",
        "parts": [{"type": "text", "text": text}],
    }


@dataclass
class StreamLog:
    """What one client saw of one request's stream."""

    chunks: list[tuple[int | None, dict[str, Any]]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c.get("delta", "") for _, c in self.chunks if c.get("type") == "text-delta")

    def record(self, frame: dict[str, Any]) -> None:
        """Fold one cf_agent_use_chat_response frame of this stream."""
        if frame.get("error"):
            self.errors.append(frame["body"])
        elif frame.get("body"):
            self.chunks.append((frame.get("seq"), json.loads(frame["body"])))
        if frame.get("done"):
            self.done = frame

    @property
    def seqs(self) -> list[int | None]:
        return [s for s, _ in self.chunks]


#: Whom the test clients are, unless a test says otherwise (chat.access principals).
TEST_PRINCIPAL = "test:client"


def access_token(principal: str = TEST_PRINCIPAL) -> str:
    """A token the test stack accepts for `principal` (signed with the tests' SECRET_KEY)."""
    from chat.access import issue_token

    return issue_token(principal)


def auth_headers(principal: str = TEST_PRINCIPAL) -> dict[str, str]:
    """HTTP headers for get-messages as `principal`."""
    return {"Authorization": f"Bearer {access_token(principal)}"}


class ChatClient:
    """A bare WebSocket client speaking the cf_agent protocol, recording every frame.

    It connects as TEST_PRINCIPAL (a token in the query string) unless given another `principal`,
    or `principal=None` and a session `cookie` ("sessionid=...") or nothing at all.
    """

    def __init__(
        self,
        port: int,
        name: str,
        agent: str = "assistant",
        *,
        prefix: str = "",
        principal: str | None = TEST_PRINCIPAL,
        cookie: str | None = None,
    ) -> None:
        """prefix: where the host site mounts the WebSocket routes ("/support"), none for the demo."""
        token = f"&token={access_token(principal)}" if principal is not None else ""
        self.url = f"ws://127.0.0.1:{port}{prefix}/agents/{agent}/{name}?_pk={uuid.uuid4()}{token}"
        self.origin = f"http://127.0.0.1:{port}"
        self.headers = {"Cookie": cookie} if cookie else {}
        self.ws: Any = None
        self.frames: list[dict[str, Any]] = []

    async def __aenter__(self) -> ChatClient:
        self.ws = await websockets.connect(
            self.url, origin=self.origin, max_size=None, additional_headers=self.headers
        )
        return self

    async def close_code(self, timeout: float = 10) -> int | None:
        """Read until the server closes the socket; its close code (the frames before are kept)."""
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                await self.recv(timeout)
        return self.ws.close_code  # type: ignore[no-any-return]

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()

    async def send(self, frame: str | dict[str, Any]) -> None:
        await self.ws.send(frame if isinstance(frame, str) else json.dumps(frame))

    async def recv(self, timeout: float = 10) -> dict[str, Any]:
        frame = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.frames.append(frame)
        return frame

    async def recv_type(self, frame_type: str, timeout: float = 10) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            frame = await self.recv(max(0.01, deadline - time.monotonic()))
            if frame.get("type") == frame_type:
                return frame

    async def follow(
        self,
        request_id: str,
        log: StreamLog | None = None,
        *,
        timeout: float = 30,
        stop_after: int | None = None,
    ) -> StreamLog:
        """Collect response frames of one request until done (or until stop_after chunks)."""
        log = log or StreamLog()
        deadline = time.monotonic() + timeout
        while log.done is None:
            if stop_after is not None and len(log.chunks) >= stop_after:
                return log
            frame = await self.recv(max(0.01, deadline - time.monotonic()))
            if frame.get("type") == "cf_agent_use_chat_response" and frame.get("id") == request_id:
                log.record(frame)
        return log


def start_beat(env: dict[str, str], log_dir: Path, *, app: str = "thinkproject") -> Proc:
    schedule = log_dir / f"beat-{uuid.uuid4().hex[:6]}.db"
    args = [str(BIN / "celery"), "-A", app, "beat", "-l", "info", "--schedule", str(schedule)]
    proc = Proc("beat", args, env, log_dir / f"beat-{uuid.uuid4().hex[:6]}.log").start()
    wait_until(lambda: "beat: Starting" in proc.log() or proc.popen.poll() is not None, 30, "beat to start")  # type: ignore[union-attr]
    return proc


def worker_children(worker: Proc) -> list[int]:
    """Pool child pids of a prefork worker (the processes that run the tasks)."""
    assert worker.popen is not None
    path = Path(f"/proc/{worker.popen.pid}/task/{worker.popen.pid}/children")
    return [int(pid) for pid in path.read_text().split()] if path.exists() else []


@dataclass
class ConversationLog:
    """Everything one client saw of a conversation's turns, in order, keyed by request id."""

    order: list[str] = field(default_factory=list)
    streams: dict[str, StreamLog] = field(default_factory=dict)
    recovering: list[bool] = field(default_factory=list)
    messages: list[list[dict[str, Any]]] = field(default_factory=list)

    def stream(self, request_id: str) -> StreamLog:
        if request_id not in self.streams:
            self.order.append(request_id)
            self.streams[request_id] = StreamLog()
        return self.streams[request_id]

    @property
    def text(self) -> str:
        return "".join(self.streams[r].text for r in self.order)

    @property
    def finished(self) -> bool:
        return any(
            s.done is not None and s.done.get("outcome") in ("completed", "error")
            for s in self.streams.values()
        ) or any(s.done is not None and s.done.get("error") for s in self.streams.values())


async def transcript_of(agent: str, name: str) -> list[dict[str, Any]]:
    """A conversation's stored transcript, read from async test code."""
    from asgiref.sync import sync_to_async

    from chat.models import Conversation
    from chat.transcript.selectors import messages_list

    conversation = await Conversation.objects.aget(agent=agent, name=name)
    return await sync_to_async(messages_list)(conversation_id=conversation.pk)


def continuation_completed(log: ConversationLog) -> bool:
    """A continuation (after a tool's answer, or a recovery's) ended well: its message is stored whole."""
    return any(
        s.done is not None and s.done.get("continuation") and s.done.get("outcome") == "completed"
        for s in log.streams.values()
    )


async def follow_conversation(
    client: ChatClient,
    log: ConversationLog | None = None,
    *,
    timeout: float = 60,
    until: Callable[[ConversationLog], bool] | None = None,
) -> ConversationLog:
    """Collect every turn of the conversation (recoveries included) until one completes or errors."""
    log = log or ConversationLog()
    deadline = time.monotonic() + timeout
    stop = until or (lambda log: log.finished)
    while not stop(log):
        frame = await client.recv(max(0.01, deadline - time.monotonic()))
        kind = frame.get("type")
        if kind == "cf_agent_chat_recovering":
            log.recovering.append(bool(frame["recovering"]))
        elif kind == "cf_agent_chat_messages":
            log.messages.append(frame["messages"])
        elif kind == "cf_agent_use_chat_response":
            log.stream(frame["id"]).record(frame)
    return log


def numbers(n: int, start: int = 1) -> str:
    """What the scripted model says for `count to n`."""
    return " ".join(str(i) for i in range(start, n + 1))


def assistant_text(messages: list[dict[str, Any]]) -> str:
    """The concatenated text of every assistant message of a transcript."""
    return "".join(
        p.get("text", "")
        for m in messages
        if m["role"] == "assistant"
        for p in m["parts"]
        if p["type"] == "text"
    )


FILLER = "The customer asked about the order and the assistant explained the delivery schedule. " * 2


def seed(agent: str, name: str, count: int = 6) -> None:
    """A stored history of about 55 model tokens per message."""
    from chat.agents import open_agent
    from chat.models import Message

    conversation = open_agent(agent, name, owner=TEST_PRINCIPAL)
    for i in range(count):
        Message.objects.create(
            conversation_id=conversation.conversation_id,
            message_id=f"h{i}",
            role="user" if i % 2 == 0 else "assistant",
            parts=[{"type": "text", "text": f"{i}: {FILLER}"}],
            position=i,
        )


def http_get(
    port: int, path: str, session: str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """GET a path of a site on 127.0.0.1 (as the user of a sessionid cookie): status and body."""
    import urllib.error
    import urllib.request

    headers = {**(headers or {}), **({"Cookie": f"sessionid={session}"} if session else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@contextlib.contextmanager
def row_locked_elsewhere(model: Any, pk: Any) -> Iterator[None]:
    """Hold `SELECT ... FOR UPDATE` on one row from another thread (its own DB connection)."""
    from django.db import connection, transaction

    locked, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                model.objects.select_for_update().get(pk=pk)
                locked.set()
                release.wait(15)
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)
            locked.set()
        finally:
            connection.close()

    thread = threading.Thread(target=hold, name="row-lock-holder")
    thread.start()
    try:
        assert locked.wait(15), "the other connection never took the lock"
        assert not errors, errors
        yield
    finally:
        release.set()
        thread.join(15)
    assert not thread.is_alive()
