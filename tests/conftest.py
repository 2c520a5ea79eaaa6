"""Shared fixtures: the scripted model, and a real worker + daphne stack on the test database."""

from __future__ import annotations

import os
import signal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import redis  # noqa: E402
from django.conf import settings  # noqa: E402

from tests import forkserver  # noqa: E402
from tests.support import Proc, stack_env, start_beat, start_daphne, start_worker  # noqa: E402
from tests.workers import WorkerPool, answering, consume, drop_parking_queues, stop_consuming  # noqa: E402
from think_scripted.server import ScriptedModelServer  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def forked_workers() -> Iterator[None]:
    """The suite's workers are forked from a process that imported litellm, Celery and Django once
    (tests/forkserver.py), instead of each importing them again (THINK_TEST_EXEC_WORKERS=1: exec'd)."""
    import tests.support

    tests.support.FORK_WORKERS = os.environ.get("THINK_TEST_EXEC_WORKERS", "") not in ("1", "true")
    yield
    forkserver.stop()


@pytest.fixture(scope="session", autouse=True)
def flush_retries_a_deadlock() -> Iterator[None]:
    """The flush after a transactional test (one TRUNCATE of every table, locking them in turn) may
    deadlock with a worker or a recovery tick of a stack that outlives the test, whose transaction
    already holds one of those tables and asks for another; Postgres then aborts one of the two. When
    it aborts the flush, the flush runs again (the worker's side retries at its next tick)."""
    import time

    from django.db import OperationalError
    from django.db.backends.base.operations import BaseDatabaseOperations

    original = BaseDatabaseOperations.execute_sql_flush

    def execute_sql_flush(self: BaseDatabaseOperations, sql_list: list[str]) -> None:
        for attempt in range(5):
            try:
                return original(self, sql_list)
            except OperationalError as exc:
                if "deadlock detected" not in str(exc) or attempt == 4:
                    raise
                time.sleep(0.05 * (attempt + 1))

    BaseDatabaseOperations.execute_sql_flush = execute_sql_flush  # type: ignore[method-assign]
    yield
    BaseDatabaseOperations.execute_sql_flush = original  # type: ignore[method-assign]


@pytest.fixture(scope="session", autouse=True)
def drop_run_queue() -> Iterator[None]:
    """Each run has its own Celery queue and prefixes (tests/settings.py): nothing to wipe before, and
    concurrent runs never see each other's work. The run's queue is removed when it ends."""
    yield
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(queue, f"{queue}-recovery")


@pytest.fixture(autouse=True)
def live_async_connection(request: pytest.FixtureRequest) -> None:
    """The thread that runs the tests' sync_to_async calls keeps its Django connection from test to
    test; a test that ends the backends it opened (tests/operator_support.terminate_new_backends) may
    end that one too, and the next test to use the thread would fail on it (AdminShutdown). Before each
    database test, that thread drops a connection that no longer answers, and opens a fresh one on use."""
    if request.node.get_closest_marker("django_db") is None:
        return
    from asgiref.sync import SyncToAsync
    from django.db import connections

    def drop_dead() -> None:
        for conn in connections.all(initialized_only=True):
            if conn.connection is not None and not conn.is_usable():
                conn.close()

    with request.getfixturevalue("django_db_blocker").unblock():
        # The one thread that runs thread-sensitive sync_to_async calls outside an async_to_sync.
        SyncToAsync.single_thread_executor.submit(drop_dead).result()


@pytest.fixture(scope="session")
def scripted_model() -> Iterator[ScriptedModelServer]:
    server = ScriptedModelServer(token_rate=0)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def in_process_model(
    scripted_model: ScriptedModelServer, settings: Any, stack_environment: dict[str, str]
) -> str:
    """Turns run in the test process itself (Think.chat()) reach the test's scripted model.

    stack_environment closes, at the end, the connections their database threads leave open.
    """
    from think_scripted.kwargs import litellm_kwargs

    settings.THINK = {**settings.THINK, "MODEL": litellm_kwargs(scripted_model.url)}
    return scripted_model.url


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def stack_environment(
    django_db_setup: Any, django_db_blocker: Any, scripted_model: ScriptedModelServer
) -> Iterator[dict[str, str]]:
    from django.db import connection

    yield stack_env(database_name=connection.settings_dict["NAME"], model_url=scripted_model.url)
    # Connections left by child processes or by async ORM threads would block dropping the test database.
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


class Stack:
    def __init__(self, env: dict[str, str], log_dir: Path, *, warm_workers: int = 0) -> None:
        self.env = env
        self.log_dir = log_dir
        self.workers: list[Proc] = []
        self.queue = settings.CELERY_TASK_DEFAULT_QUEUE + env.get("THINK_TEST_QUEUE_SUFFIX", "")
        self.warm_workers = warm_workers
        self.consuming = False  # the shared stack's worker, on the run's queue (shared_stack_aside)
        self.pools: dict[tuple[tuple[str, str], ...], WorkerPool] = {}
        if warm_workers:
            self._pool({})
        self.daphne, self.port = start_daphne(env, log_dir)

    def _pool(self, env: dict[str, str]) -> WorkerPool:
        """The warm workers of the stack's environment plus `env`: `warm_workers` of its own one, one of
        any other (a test that wants two of those finds the second started when it took the first)."""
        key = tuple(sorted(env.items()))
        if key not in self.pools:
            size = self.warm_workers if not env else 1
            self.pools[key] = WorkerPool({**self.env, **env}, self.log_dir, queue_name=self.queue, size=size)
        return self.pools[key]

    def start_worker(self, *, env: dict[str, str] | None = None, **kwargs: Any) -> Proc:
        """A worker of this stack; `env` adds to the stack's environment (settings knobs). With warm
        workers, one of the default pool and concurrency comes ready from a pool (tests/workers.py)."""
        if self.warm_workers and not kwargs:
            worker = self._pool(env or {}).take()
        else:
            worker = start_worker({**self.env, **(env or {})}, self.log_dir, **kwargs)
        self.workers.append(worker)
        return worker

    def stop_workers(self) -> None:
        """End the workers a test started, at once: SIGKILL, as nothing of a finished test needs their
        warm shutdown (4 to 5 s each, which wrote after the test had ended and its data was flushed);
        the tests of a warm shutdown send SIGTERM themselves."""
        for worker in self.workers:
            worker.kill(signal.SIGKILL)
        self.workers.clear()

    def start_beat(self) -> Proc:
        self.beat = start_beat(self.env, self.log_dir)
        return self.beat

    def stop(self) -> None:
        for pool in self.pools.values():
            pool.close()
        if self.pools:
            drop_parking_queues(settings.CELERY_BROKER_URL, self.queue)
        for proc in [*self.workers, self.daphne, *([self.beat] if getattr(self, "beat", None) else [])]:
            proc.stop()


# The shared stack of this process (a pytest-xdist runner has its own), once a test has asked for it;
# and the modules with a test that asks for it.
_shared: list[Stack] = []
_modules_with_stack: set[str] = set()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "stack" in getattr(item, "fixturenames", ()):
            _modules_with_stack.add(item.nodeid.split("::")[0])


@pytest.fixture(scope="session")
def stack(stack_environment: dict[str, str], log_dir: Path) -> Iterator[Stack]:
    """daphne plus one worker, shared by the end-to-end tests that do not kill processes; it holds a
    liveness session but leaves the search for dead workers to the stacks whose workers tests kill.
    Its worker consumes the run's queue only during the modules that use it (shared_stack_aside)."""
    stack = Stack({**stack_environment, "THINK_TEST_LIVENESS_POLL_MS": "0"}, log_dir)
    stack.start_worker()
    answering(stack.workers[0])
    stack.consuming = True
    _shared.append(stack)
    yield stack
    _shared.clear()
    stack.stop()


@pytest.fixture(scope="module", autouse=True)
def shared_stack_aside(request: pytest.FixtureRequest) -> None:
    """A module without the shared stack finds no worker on the run's queue: what it enqueues stays
    there, as it would with no stack at all, whatever ran before it on this runner. A module with it
    has its worker from before its first fixture (autouse fixtures come first in their scope)."""
    if request.node.nodeid in _modules_with_stack:
        shared = request.getfixturevalue("stack")
        if not shared.consuming:
            consume(shared.workers[0], shared.queue)
            shared.consuming = True
    elif _shared and _shared[0].consuming:
        stop_consuming(_shared[0].workers[0], _shared[0].queue)
        _shared[0].consuming = False


@pytest.fixture(scope="session")
def recovery_stack(stack_environment: dict[str, str], log_dir: Path) -> Iterator[Stack]:
    """daphne and beat, for the whole run, for tests that start and kill their own workers (warm ones
    from a pool), on a queue of their own; each test stops the workers it started."""
    stack = Stack({**stack_environment, "THINK_TEST_QUEUE_SUFFIX": "-recovery"}, log_dir, warm_workers=2)
    stack.start_beat()
    yield stack
    stack.stop()


@pytest.fixture
def quiet_broker(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """What would reach the broker (alarms fired at once, turns sent) is recorded instead, so a test runs
    it in-process itself (tests/inprocess.py)."""
    import chat.transcript.turns
    from recovery.process import dispatch

    sent: dict[str, list[Any]] = {"alarms": [], "turns": []}
    monkeypatch.setattr(dispatch, "fire_later", sent["alarms"].append)
    monkeypatch.setattr(chat.transcript.turns, "turn_send", sent["turns"].append)
    return sent
