"""Infrastructure faults mid-turn: Redis (broker, channel layer, cache) and Postgres go away and come back.

Neither test touches the shared servers: each runs its stack against a private server of its own
(thinkproject/embedded.py: the pip-installed Valkey and PostgreSQL that `make run` falls back on), which
it SIGKILLs, as a crash would, and starts again on the same port. The Redis server has no persistence:
every broker message, channel-layer message and group, and cache key is gone, as after a real restart.
The Postgres postmaster is killed and stays down for longer than the lease TTL; its backends die with
it, and the restarted server recovers its data from the WAL.

In each case the turn completes with its whole answer (a terminal error fails the test), the stored
transcript holds it exactly once, and a client that connects after the fault gets it. The database
outage outlasts the lease, so its turn must be one that recovery continued.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import websockets
from asgiref.sync import sync_to_async

from chat.models import Conversation
from recovery.models import Fiber
from tests.support import (
    ROOT,
    ChatClient,
    ConversationLog,
    Proc,
    assistant_text,
    chat_request,
    follow_conversation,
    numbers,
    start_beat,
    start_daphne,
    start_worker,
    user_message,
    wait_until,
)
from thinkproject.embedded import PrivatePostgres, PrivateRedis, scratch_dir

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# Lease TTL + tick + the continuation, with a wide margin for a loaded 2-core machine.
BUDGET_S = 90


def outage_s() -> float:
    """Longer than the stacks' lease TTL (tests/settings.py): the turn's lease lapses during the outage."""
    from chat.conf import think_setting

    return float(think_setting("LEASE_TTL_S")) + 2.0


@dataclass(frozen=True)
class Turn:
    prompt: str
    count: int
    fault_after: int  # chunks the first client sees before the fault

    @property
    def expected(self) -> str:
        return numbers(self.count)


# At 20 chunks/s the turn's guard does the timed flushes; at 300/s the producer flushes full batches.
SLOW = Turn("count to 80 [rate 20]", 80, 15)
FAST = Turn("count to 1500 [rate 300]", 1500, 100)


class FaultStack:
    """daphne, beat and a worker of one fault test, on a queue of its own; all stopped at the end."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir = env, log_dir
        self.procs: list[Proc] = []
        daphne, self.port = start_daphne(env, log_dir)
        self.procs.append(daphne)
        self.procs.append(start_beat(env, log_dir))
        self.procs.append(start_worker(env, log_dir, name="faults-worker"))

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}: {p.log_path}" for p in self.procs)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "redis")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_stack(
    stack_environment: dict[str, str], log_dir: Path, private_redis: PrivateRedis
) -> Iterator[FaultStack]:
    env = {
        **stack_environment,
        "THINK_TEST_REDIS_URL": private_redis.url().rsplit("/", 1)[0],
        "THINK_TEST_QUEUE_SUFFIX": "-redis",
    }
    stack = FaultStack(env, log_dir)
    try:
        yield stack
    finally:
        stack.stop()


@dataclass(frozen=True)
class PrivateDatabase:
    server: PrivatePostgres
    name: str


@pytest.fixture(scope="module")
def private_database() -> Iterator[PrivateDatabase]:
    """A throwaway private Postgres with a migrated database of the apps, under .run/ (as root it runs
    as nobody, who cannot enter pytest's temporary directories)."""
    directory = scratch_dir("faults-")
    server = PrivatePostgres(directory, durable=False)
    try:
        server.start()
        name = "thinkproject_faults"
        with psycopg.connect(server.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        env = {**os.environ, "DATABASE_URL": server.url(name), "DJANGO_SETTINGS_MODULE": "tests.settings"}
        env.pop("THINK_TEST_DATABASE_NAME", None)
        migrated = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        yield PrivateDatabase(server, name)
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def on_private_database(private_database: PrivateDatabase) -> AsyncIterator[PrivateDatabase]:
    """The async ORM of this process reads the private database for the test, and the session's test
    database again after it: the settings dict every thread's connection shares points there, and the
    ORM thread's connection is closed on each change (the test makes no query from its own thread)."""
    from django.db import connection

    settings_dict = connection.settings_dict
    saved = {key: settings_dict[key] for key in ("HOST", "PORT", "NAME", "USER", "PASSWORD")}
    server = private_database.server
    settings_dict.update(
        HOST="127.0.0.1",
        PORT=str(server.port),
        NAME=private_database.name,
        USER="postgres",
        PASSWORD=server.password,
    )
    await sync_to_async(close_connection)()
    try:
        yield private_database
    finally:
        settings_dict.update(saved)
        await sync_to_async(close_connection)()


@pytest.fixture
def postgres_stack(
    stack_environment: dict[str, str], log_dir: Path, private_database: PrivateDatabase
) -> Iterator[FaultStack]:
    env = {
        **stack_environment,
        "DATABASE_URL": private_database.server.url(private_database.name),
        "THINK_TEST_DATABASE_NAME": private_database.name,
        "THINK_TEST_QUEUE_SUFFIX": "-postgres",
    }
    stack = FaultStack(env, log_dir)
    try:
        yield stack
    finally:
        stack.stop()


def close_connection() -> None:
    from django.db import connection

    connection.close()


async def follow_after_fault(client: ChatClient, log: ConversationLog, expected: str, timeout: float) -> None:
    """A client that connected after the fault: ACK every resume offer, follow until the turn ends."""

    def done(log: ConversationLog) -> bool:
        # The transcript follows a turn's done frame: wait for it, unless the turn ended in an error.
        ended_in_error = any(s.errors for s in log.streams.values())
        return ended_in_error or bool(log.messages and assistant_text(log.messages[-1]) == expected)

    deadline = time.monotonic() + timeout
    while not done(log):
        frame = await client.recv(max(0.01, deadline - time.monotonic()))
        kind = frame.get("type")
        if kind == "cf_agent_stream_resuming":
            await client.send({"type": "cf_agent_stream_resume_ack", "id": frame["id"]})
        elif kind == "cf_agent_chat_messages":
            log.messages.append(frame["messages"])
        elif kind == "cf_agent_use_chat_response":
            log.stream(frame["id"]).record(frame)


def turn_state(name: str) -> tuple[list[dict[str, Any]], bool, dict[str, Any] | None]:
    """(stored transcript, whether a fiber is still active, the terminal record) of a conversation."""
    from chat.transcript.selectors import messages_list

    conversation = Conversation.objects.get(agent="assistant", name=name)
    active = Fiber.objects.filter(conversation=conversation).active().exists()
    return messages_list(conversation_id=conversation.pk), active, conversation.last_terminal


async def turn_ended(name: str, expected: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    deadline = time.monotonic() + BUDGET_S
    while time.monotonic() < deadline:
        transcript, active, terminal = await sync_to_async(turn_state)(name)
        if not active and (terminal or assistant_text(transcript) == expected):
            return transcript, terminal
        await asyncio.sleep(0.25)
    raise AssertionError(f"the turn of {name} did not end within {BUDGET_S}s")


def assert_clean(log: ConversationLog) -> None:
    """Every stream a client saw has its seqs contiguous from 0: nothing missed, nothing twice."""
    for request_id in log.order:
        seqs = log.streams[request_id].seqs
        assert seqs == list(range(len(seqs))), f"stream {request_id} has a gap or duplicate: {seqs}"


async def run_with_fault(
    port: int, turn: Turn, fault: Callable[[], Awaitable[None]]
) -> tuple[str, ConversationLog]:
    """Start the turn, apply the fault after some chunks, and check what clients and Postgres hold.

    Returns the conversation's name and what the client connected through the fault saw.
    """
    name = f"infra-{uuid.uuid4().hex[:8]}"
    first = ConversationLog()
    async with ChatClient(port, name) as client:
        request_id = uuid.uuid4().hex[:10]
        await client.send(chat_request(request_id, [user_message(turn.prompt)]))
        await follow_conversation(
            client, first, until=lambda lg: len(lg.stream(request_id).chunks) >= turn.fault_after, timeout=30
        )
        await fault()
        try:  # the server may drop this socket (a Redis restart ends every consumer); that is allowed
            await follow_conversation(client, first, timeout=BUDGET_S)
        except websockets.ConnectionClosed:
            pass
    later = ConversationLog()
    async with ChatClient(port, name) as client:
        await follow_after_fault(client, later, turn.expected, BUDGET_S)
    transcript, terminal = await turn_ended(name, turn.expected)

    assert_clean(first)
    assert turn.expected.startswith(first.text), "the first client saw text that is not the answer"
    assert_clean(later)
    assert [m["role"] for m in transcript].count("user") == 1, "the user message is stored once"
    assert terminal is None, f"the turn ended in an error instead of its answer: {terminal}"
    assert assistant_text(transcript) == turn.expected, "stored text: nothing lost, nothing twice"
    assert later.messages and assistant_text(later.messages[-1]) == turn.expected
    assert turn.expected.endswith(later.text), "the later client's streams end the answer exactly"
    return name, first


async def test_redis_restart_mid_turn(redis_stack: FaultStack, private_redis: PrivateRedis) -> None:
    async def restart() -> None:
        pid = private_redis.pid
        private_redis.kill()  # SIGKILL
        assert private_redis.proc is not None and private_redis.proc.returncode == -9
        await asyncio.sleep(1.0)
        await asyncio.to_thread(private_redis.start)
        assert private_redis.pid != pid

    try:
        name, _ = await run_with_fault(redis_stack.port, SLOW, restart)
        fibers = await Fiber.objects.filter(conversation__name=name).acount()
        assert fibers == 1, "the turn was not even interrupted: it streamed into Postgres throughout"
        # The restart wiped the tick's timestamp from the cache: only a tick sent by beat and run by the
        # worker after it makes the health check pass, so beat and the worker both reconnected.
        await asyncio.to_thread(wait_until, lambda: healthy(redis_stack.port), 30, "/healthz to pass")
    except BaseException:
        print(redis_stack.logs())
        raise


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return response.status == 200
    except OSError:  # a 503 (HTTPError) too
        return False


@pytest.mark.parametrize("turn", [SLOW, FAST], ids=["guard-flushes", "producer-flushes"])
async def test_postgres_crash_mid_turn(
    postgres_stack: FaultStack, on_private_database: PrivateDatabase, turn: Turn
) -> None:
    length = outage_s()
    server = on_private_database.server

    async def crash() -> None:
        pid = server.pid
        server.kill()  # SIGKILL of the postmaster
        assert server.proc is not None and server.proc.returncode == -9
        await asyncio.sleep(length)
        await asyncio.to_thread(server.start)  # same port, same data directory: crash recovery
        assert server.pid != pid
        await sync_to_async(close_connection)()  # the connection of the ORM's thread died with it

    try:
        name, first = await run_with_fault(postgres_stack.port, turn, crash)
    except BaseException:
        print(postgres_stack.logs())
        raise
    assert first.text == turn.expected, "the client connected through the outage saw the whole answer"
    fibers = [f async for f in Fiber.objects.filter(conversation__name=name).order_by("created_at")]
    # Any outage that kills the turn's connection interrupts it (seen with 0.5 s too); this one also
    # outlasts the lease, so the worker cannot hand the turn over itself before the lease lapses.
    assert len(fibers) >= 2, "the outage interrupted the turn and recovery continued it"
    assert fibers[0].status == Fiber.Status.RECOVERED
    assert fibers[-1].status == Fiber.Status.COMPLETED, "a continuation finished the turn"
