"""Warm Celery workers: started ahead of need, parked, and handed to a stack when a test wants one.

A worker takes a while to become ready (about 4.5 s exec'd; forked from the runner's fork server,
tests/forkserver.py, still its Django set-up and broker connections), and the tests that kill workers
start two or three each. The pool keeps `size` workers of a stack's environment ready, each consuming
only a parking queue of its own; `take()` tells one by Celery's remote control to consume the stack's
queue and to stop consuming its parking queue, and starts a replacement in the background. The worker
handed over is a real process of its own, killed by the test with real signals like any other.

A parked worker holds its liveness session but judges nobody (recovery.tasks: a worker that does not
consume the queue takeovers send recovery work to leaves the dead to those that do), so a test whose
stack has no live worker sees the same recovery as before the pool.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support import Proc, start_worker


class WorkerPool:
    def __init__(self, env: dict[str, str], log_dir: Path, *, queue_name: str, size: int = 2) -> None:
        self.env, self.log_dir, self.queue_name = env, log_dir, queue_name
        self._parked: queue.Queue[tuple[Proc, str] | BaseException] = queue.Queue()
        self._starting: list[threading.Thread] = []
        self._closed = threading.Event()
        for _ in range(size):
            self._start_one()

    def _start_one(self) -> None:
        park = f"{self.queue_name}-park-{uuid.uuid4().hex[:8]}"

        def start() -> None:
            try:
                worker = start_worker(self.env, self.log_dir, name="parked", queues=park)
                answering(worker)
            except BaseException as exc:  # the taker hears of it
                self._parked.put(exc)
                return
            if self._closed.is_set():
                worker.stop()
            else:
                self._parked.put((worker, park))

        thread = threading.Thread(target=start, name=f"start {park}", daemon=True)
        self._starting = [*(t for t in self._starting if t.is_alive()), thread]
        thread.start()

    def take(self, timeout: float = 120) -> Proc:
        """A ready worker consuming the stack's queue (waiting for one to be ready if need be)."""
        while True:
            item = self._parked.get(timeout=timeout)
            self._start_one()
            if isinstance(item, BaseException):
                raise item
            worker, park = item
            if worker.popen is not None and worker.popen.poll() is None:
                break
            # It died while parked (nothing kills parked workers, but a take must not return a corpse).
        try:
            hand_over(worker, park=park, to=self.queue_name)
        except BaseException:
            worker.stop()
            raise
        return worker

    def close(self) -> None:
        self._closed.set()
        for thread in self._starting:
            thread.join(timeout=90)
        while True:
            try:
                item = self._parked.get_nowait()
            except queue.Empty:
                return
            if not isinstance(item, BaseException):
                item[0].stop()


# Remote control commands travel by Redis pub/sub, which keeps nothing for a subscriber that is not
# listening at that instant: a command is sent again until answered (both are idempotent).
ANSWER_WITHIN_S = 1.0
TRIES = 20


def answering(worker: Proc) -> None:
    """Wait until a worker answers remote control (its " ready." comes a moment before it listens)."""
    from thinkproject.celery import app

    _until_answered(worker, lambda: app.control.ping([worker.hostname], timeout=ANSWER_WITHIN_S), "ping")


def hand_over(worker: Proc, *, park: str, to: str) -> None:
    """Make a parked worker consume `to` instead of its parking queue; both answered before it returns."""
    consume(worker, to)
    stop_consuming(worker, park)


def consume(worker: Proc, queue_name: str) -> None:
    """The worker consumes `queue_name` too, once it has said so."""
    from thinkproject.celery import app

    _control(worker, app.control.add_consumer, queue_name)


def stop_consuming(worker: Proc, queue_name: str) -> None:
    """The worker takes nothing more from `queue_name` (what it holds already, it runs)."""
    from thinkproject.celery import app

    _control(worker, app.control.cancel_consumer, queue_name)


def _control(worker: Proc, command: Any, queue_name: str) -> None:
    def send() -> list[dict[str, Any]]:
        return command(  # type: ignore[no-any-return]
            queue_name, destination=[worker.hostname], reply=True, limit=1, timeout=ANSWER_WITHIN_S
        )

    _until_answered(worker, send, f"{command.__name__}({queue_name})")


def _until_answered(worker: Proc, send: Callable[[], list[dict[str, Any]]], what: str) -> None:
    replies: list[dict[str, Any]] = []
    for _ in range(TRIES):
        replies = send()
        answer = replies[0].get(worker.hostname, {}) if replies else {}
        if isinstance(answer, dict) and "ok" in answer:
            return
        if worker.popen is not None and worker.popen.poll() is not None:
            break
    raise AssertionError(f"{what} to {worker.hostname} unanswered: {replies!r}\n{worker.log()}")


def drop_parking_queues(broker_url: str, queue_name: str) -> None:
    """What the parking queues leave in the broker (their bindings) after a run."""
    import redis

    client = redis.Redis.from_url(broker_url)
    with contextlib.suppress(redis.RedisError):
        keys = list(client.scan_iter(match=f"*{queue_name}-park-*", count=1000))
        if keys:
            client.delete(*keys)
