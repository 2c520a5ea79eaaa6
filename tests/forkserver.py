"""A fork server for the tests' Celery workers.

A worker spends most of its 4 to 5 s start importing (litellm alone about 3 s of CPU and 190 MB), and a
run starts about a hundred of them on two cores. The fork server is one process per test runner that
imports those third-party modules once and then forks a worker for each request: the child starts a
session of its own, points its output at the worker's log, takes the worker's environment and runs
`celery -A ... worker ...` as the command line would, importing Django's settings and the apps itself
(nothing of the project is imported before the fork, so each worker reads its own environment).

The worker is a real process of its own, killed with real signals like any other; only its start
differs from an exec, which bench/worker_start.py measures for deployments.

Run as `python -u -m tests.forkserver`: requests are JSON lines on stdin (args, env, log, cwd), each
answered with a JSON line on stdout ({"pid": ...} or {"error": ...}).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# What every worker imports, in the order it would (none of it reads the project's settings).
PRELOAD = (
    "litellm",
    "openai",
    "aiohttp",
    "psycopg",
    "redis",
    "celery",
    "celery.bin.celery",
    "celery.worker",
    "celery.concurrency.thread",
    "kombu.transport.redis",
    "django.db.models",
    "django.contrib.admin",
    "channels.layers",
    "channels_redis.core",
    "daphne.server",
    "opentelemetry.trace",
)


def serve() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a module that cannot load before the settings: the worker loads it
            print(json.dumps({"skipped": name, "why": repr(exc)}), file=sys.stderr, flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers: no zombies
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            pid = os.fork()
        except OSError as exc:
            print(json.dumps({"error": repr(exc)}), flush=True)
            continue
        if pid == 0:
            _become_worker(request)  # never returns
        print(json.dumps({"pid": pid}), flush=True)


def _become_worker(request: dict[str, Any]) -> None:
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a prefork pool waits for its children
        os.setsid()
        os.chdir(request["cwd"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["args"])
        # What an exec'd interpreter would put first on its path: PYTHONPATH, and the script's home.
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [*paths, request["cwd"]]
        from celery.__main__ import main

        main()
        code = 0
    except SystemExit as exiting:
        code = exiting.code if isinstance(exiting.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class Forked:
    """What tests.support.Proc needs of a worker forked by the server (it is not this process's child:
    its state is read from /proc)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError, IndexError):
                state = "X"
            if state in ("Z", "X"):
                self.returncode = -1  # the exit status went to the server, which let the kernel reap it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["forked worker"], timeout or 0)
            time.sleep(0.02)
        return self.returncode or 0


class Server:
    """The fork server of this process (one per test runner), started on first use."""

    def __init__(self, env: dict[str, str]) -> None:
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "tests.forkserver"],
            cwd=Path(__file__).resolve().parent.parent,
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        first = self._proc.stdout.readline()
        assert first and json.loads(first).get("ready"), f"the fork server did not start: {first!r}"

    def fork(self, args: list[str], env: dict[str, str], log: Path, cwd: Path) -> Forked:
        request = json.dumps({"args": args, "env": env, "log": str(log), "cwd": str(cwd)})
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(request + "\n")
            self._proc.stdin.flush()
            answer = json.loads(self._proc.stdout.readline() or "{}")
        assert "pid" in answer, f"the fork server could not start a worker: {answer!r}"
        return Forked(int(answer["pid"]))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._proc.kill()
            self._proc.wait(5)


_server: Server | None = None
_server_lock = threading.Lock()


def server(env: dict[str, str]) -> Server:
    global _server
    with _server_lock:
        if _server is None:
            _server = Server(env)
        return _server


def stop() -> None:
    global _server
    with _server_lock:
        if _server is not None:
            _server.stop()
            _server = None


if __name__ == "__main__":
    serve()
