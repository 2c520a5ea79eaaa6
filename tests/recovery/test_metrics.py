"""Prometheus metrics: values read back from the registry after driving each code path at unit level,
and the /metrics view (default registry, and multiprocess mode fed by another process)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from django.conf import settings
from django.test import Client, override_settings
from prometheus_client import REGISTRY

from chat.protocol import chunk_framer
from chat.turn.chunking import UI_CHUNK_POLICY
from recovery.engine.detection import tick_claim
from recovery.models import Fiber
from recovery.observe import diagnostics, metrics
from recovery.stream.buffer import StreamWriter
from tests.operator_support import make_conversation, make_fiber, make_incident
from thinkproject.bootstrap import reset_metrics_dir

ROOT = Path(__file__).resolve().parents[2]


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


class Delta:
    """A metric sample's change across a block."""

    def __init__(self, name: str, labels: dict[str, str] | None = None) -> None:
        self.name, self.labels = name, labels
        self.before = sample(name, labels)

    @property
    def value(self) -> float:
        return sample(self.name, self.labels) - self.before


# --------------------------------------------------------------------------------------------------------
# Turns and recoveries, from the diagnostic events
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["completed", "error", "aborted", "interrupted"])
def test_a_finished_turn_is_counted_by_outcome(outcome: str) -> None:
    counted = Delta("think_turns_total", {"outcome": outcome})
    diagnostics.emit("chat:turn:finish", {"requestId": "r-1", "status": outcome}, agent="a", name="c")
    diagnostics.emit("chat:turn:start", {"requestId": "r-1"}, agent="a", name="c")  # not an end
    assert counted.value == 1


def test_an_unexpected_turn_status_is_counted_as_other() -> None:
    counted = Delta("think_turns_total", {"outcome": "other"})
    diagnostics.emit("chat:turn:finish", {"requestId": "r-1", "status": "r-1-specific"})
    assert counted.value == 1


@pytest.mark.parametrize(
    ("event_type", "reason", "labels"),
    [
        ("chat:recovery:completed", None, {"outcome": "completed", "reason": "none"}),
        (
            "chat:recovery:skipped",
            "conversation_changed",
            {"outcome": "skipped", "reason": "conversation_changed"},
        ),
        (
            "chat:recovery:exhausted",
            "max_attempts_exceeded",
            {"outcome": "exhausted", "reason": "max_attempts_exceeded"},
        ),
        ("chat:recovery:exhausted", "forced", {"outcome": "exhausted", "reason": "forced"}),
        ("chat:recovery:failed", "recovered turn error", {"outcome": "failed", "reason": "turn_error"}),
        # A hook's exception text never becomes a label value.
        ("chat:recovery:failed", "KeyError('req-8f3a')", {"outcome": "failed", "reason": "other"}),
    ],
)
def test_a_recovery_outcome_is_counted_with_a_bounded_reason(
    event_type: str, reason: str | None, labels: dict[str, str]
) -> None:
    counted = Delta("think_recoveries_total", labels)
    payload: dict[str, Any] = {"incidentId": "r:u", "requestId": "r", "attempt": 1}
    if reason is not None:
        payload["reason"] = reason
    diagnostics.emit(event_type, payload, agent="assistant", name="room")
    assert counted.value == 1


def test_intermediate_recovery_events_are_not_outcomes() -> None:
    before = {
        outcome: sample("think_recoveries_total", {"outcome": outcome, "reason": "none"})
        for outcome in metrics.RECOVERY_OUTCOMES
    }
    for step in ("detected", "attempt", "scheduled"):
        diagnostics.emit(f"chat:recovery:{step}", {"incidentId": "r:u"})
    after = {
        outcome: sample("think_recoveries_total", {"outcome": outcome, "reason": "none"})
        for outcome in before
    }
    assert after == before
    assert sample("think_recoveries_total", {"outcome": "scheduled", "reason": "none"}) == 0


# --------------------------------------------------------------------------------------------------------
# The stream writer: observed per flush, never per chunk
# --------------------------------------------------------------------------------------------------------


class Published:
    def __init__(self) -> None:
        self.batches: list[list[tuple[int, str]]] = []

    async def __call__(self, frames: list[tuple[int, str]]) -> None:
        self.batches.append(frames)


@pytest.fixture
def metric_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every observe/inc/set of any prometheus_client metric, by name."""
    calls: list[str] = []
    for cls, method in (
        (prometheus_client.Histogram, "observe"),
        (prometheus_client.Counter, "inc"),
        (prometheus_client.Gauge, "inc"),
        (prometheus_client.Gauge, "set"),
    ):
        original = getattr(cls, method)

        def record(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(self._name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, record)
    return calls


def writer(publish: Published) -> StreamWriter:
    return StreamWriter(
        stream_id=None,
        fiber_id=None,
        fencing=1,
        frame=chunk_framer("r-1"),
        policy=UI_CHUNK_POLICY,
        publish=publish,
    )


class Clock:
    """Stands in for the stream module's monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    import recovery.stream.buffer
    import recovery.stream.flusher

    fake = Clock()
    monkeypatch.setattr(recovery.stream.buffer, "time", fake)
    monkeypatch.setattr(recovery.stream.flusher, "time", fake)
    return fake


@override_settings(THINK={**settings.THINK, "STREAM_PERSIST": False, "FLUSH_EVERY_CHUNKS": 1000})
async def test_a_flush_observes_its_size_and_its_oldest_chunks_wait(
    metric_calls: list[str], clock: Clock
) -> None:
    flushes = Delta("think_stream_flush_chunks_count")
    chunks = Delta("think_stream_flush_chunks_sum")
    latency = Delta("think_stream_chunk_latency_seconds_sum")
    fast = Delta("think_stream_chunk_latency_seconds_bucket", {"le": "0.1"})
    published = Published()
    stream = writer(published)

    stream.add({"type": "start"})
    clock.now += 0.2
    for n in range(24):
        stream.add({"type": "text-delta", "id": "t1", "delta": str(n)})
    clock.now += 0.05
    assert metric_calls == []  # nothing per chunk
    await stream.flush()
    await stream.flush()  # an empty buffer: nothing flushed, nothing observed

    # The 24 deltas of one part were coalesced into one chunk: two frames, 25 chunks observed.
    assert [len(batch) for batch in published.batches] == [2]
    assert sorted(metric_calls) == ["think_stream_chunk_latency_seconds", "think_stream_flush_chunks"]
    assert (flushes.value, chunks.value) == (1, 25)
    assert latency.value == pytest.approx(0.25)  # the oldest chunk's wait, not the newest's
    assert fast.value == 0


@override_settings(THINK={**settings.THINK, "STREAM_PERSIST": False})
async def test_each_batch_is_timed_from_its_own_first_chunk(clock: Clock) -> None:
    latency = Delta("think_stream_chunk_latency_seconds_sum")
    stream = writer(Published())
    stream.add({"type": "start"})
    clock.now += 0.3
    await stream.flush()
    stream.add({"type": "start-step"})  # a new batch starts its clock now
    clock.now += 0.01
    await stream.flush()
    assert latency.value == pytest.approx(0.31)


# --------------------------------------------------------------------------------------------------------
# Lease expiries, from the detection tick
# --------------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_tick_counts_the_leases_it_finds_expired() -> None:
    running = Delta("think_lease_expiries_total", {"status": "running"})
    handling = Delta("think_lease_expiries_total", {"status": "interrupted"})
    conversation = make_conversation()
    dead = make_fiber(conversation, Fiber.Status.RUNNING, lease_in=-timedelta(minutes=5))
    make_fiber(make_conversation(), Fiber.Status.RUNNING)  # a live lease

    assert tick_claim().fibers == [dead.pk]
    assert (running.value, handling.value) == (1, 0)

    # The recovery handler's own deadline lapses too (it died): claimed again, counted apart.
    Fiber.objects.filter(pk=dead.pk).update(lease_expires_at=dead.lease_expires_at)
    assert tick_claim().fibers == [dead.pk]
    assert (running.value, handling.value) == (1, 1)
    assert tick_claim().fibers == []


# --------------------------------------------------------------------------------------------------------
# Open incidents, read from Postgres at scrape time
# --------------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_open_incidents_are_counted_by_status_when_scraped() -> None:
    conversation = make_conversation()
    for status in ("detected", "scheduled", "scheduled", "attempting", "exhausted", "completed"):
        make_incident(conversation, status)
    registry = metrics.exposition_registry()
    counts = {
        status: registry.get_sample_value("think_incidents_open", {"status": status})
        for status in ("detected", "scheduled", "attempting", "exhausted")
    }
    assert counts == {"detected": 1, "scheduled": 2, "attempting": 1, "exhausted": None}


def test_a_database_failure_drops_the_gauge_but_not_the_scrape(caplog: pytest.LogCaptureFixture) -> None:
    # No django_db mark: any query fails, as with Postgres down.
    with caplog.at_level(logging.ERROR, logger="recovery.observe.metrics"):
        text = prometheus_client.generate_latest(metrics.exposition_registry()).decode()
    assert "think_turns_total" in text and "think_incidents_open{" not in text
    assert any("open incidents" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------------------
# GET /metrics
# --------------------------------------------------------------------------------------------------------

METRIC_NAMES = (
    "think_turns_total",
    "think_recoveries_total",
    "think_incidents_open",
    "think_stream_chunk_latency_seconds",
    "think_stream_flush_chunks",
    "think_lease_expiries_total",
)


@pytest.mark.django_db
def test_metrics_endpoint_serves_the_text_exposition(client: Client) -> None:
    make_incident(make_conversation(), "scheduled")
    diagnostics.emit("chat:turn:finish", {"requestId": "r-1", "status": "completed"})
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    for name in METRIC_NAMES:
        assert f"# TYPE {name}" in text or f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'think_incidents_open{status="scheduled"} 1.0' in text
    assert 'think_turns_total{outcome="completed"}' in text


@pytest.mark.django_db
def test_metrics_endpoint_refuses_writes(client: Client) -> None:
    assert client.post("/metrics").status_code == 405


@pytest.fixture
def multiproc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "metrics"
    path.mkdir()
    monkeypatch.setenv(metrics.MULTIPROC_ENV, str(path))
    yield path


WORKER_SCRIPT = """
from recovery.observe import metrics
metrics.turn_finished("completed")
metrics.turn_finished("completed")
metrics.flush_observed(chunks=7, oldest_age_s=0.02)
metrics.lease_expiries_observed(["running"])
"""


def _run_another_process(path: Path) -> None:
    env = {**os.environ, metrics.MULTIPROC_ENV: str(path)}
    subprocess.run([sys.executable, "-c", WORKER_SCRIPT], cwd=ROOT, env=env, check=True, timeout=60)


@pytest.mark.django_db
def test_multiprocess_mode_serves_what_every_process_wrote(client: Client, multiproc_dir: Path) -> None:
    _run_another_process(multiproc_dir)
    _run_another_process(multiproc_dir)
    files = sorted(p.name for p in multiproc_dir.iterdir())
    # One file per process and type, named after the host as well as the pid (containers share pids).
    assert files and all(name.split("_", 1)[1].startswith(f"{socket.gethostname()}-") for name in files)

    text = client.get("/metrics").content.decode()

    assert 'think_turns_total{outcome="completed"} 4.0' in text  # summed over both processes
    assert "think_stream_flush_chunks_count 2.0" in text and "think_stream_flush_chunks_sum 14.0" in text
    assert 'think_lease_expiries_total{status="running"} 2.0' in text
    assert "think_incidents_open" in text  # the gauge is computed by the serving process itself


def test_bootstrap_empties_the_metrics_directory(multiproc_dir: Path) -> None:
    (multiproc_dir / "counter_old-1.db").write_bytes(b"stale")
    (multiproc_dir / "nested").mkdir()
    assert reset_metrics_dir() == multiproc_dir
    assert list(multiproc_dir.iterdir()) == []


def test_bootstrap_creates_a_missing_metrics_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "absent" / "metrics"
    monkeypatch.setenv(metrics.MULTIPROC_ENV, str(path))
    assert reset_metrics_dir() == path and path.is_dir()


def test_bootstrap_does_nothing_without_a_metrics_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(metrics.MULTIPROC_ENV, raising=False)
    assert reset_metrics_dir() is None


def test_no_metric_has_an_id_label() -> None:
    labels = {
        label
        for metric in (metrics.TURNS, metrics.RECOVERIES, metrics.LEASE_EXPIRIES)
        for label in metric._labelnames
    }
    assert labels == {"outcome", "reason", "status"}


class HeldPublish(Published):
    """Publishes like Published, after a while; the first batch's publish (so its write) waits for
    `release` too."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def __call__(self, frames: list[tuple[int, str]]) -> None:
        if not self.batches:
            await self.release.wait()
        await asyncio.sleep(0.01)  # every write takes a while, as a statement does
        await super().__call__(frames)


@override_settings(THINK={**settings.THINK, "STREAM_PERSIST": False, "FLUSH_EVERY_CHUNKS": 1000})
async def test_a_flush_returns_only_once_every_chunk_taken_before_it_is_stored() -> None:
    """The race that lost the tails of streams under load: a flush waits for the write in flight; the
    tick right after it takes the rest of the writer's chunks before the flush resumes. The flush must
    wait for that write too, or the turn finishes (and closes its fiber) under it."""
    from recovery.stream.flusher import flusher

    published = HeldPublish()
    stream = writer(published)
    flusher().register(stream)
    try:
        stream.add({"type": "start"})  # the first content: stored at once, its write held
        first = asyncio.create_task(stream.flush())
        await asyncio.sleep(0.01)
        stream.add({"type": "text-delta", "id": "t1", "delta": "1"})
        stream.add({"type": "text-delta", "id": "t1", "delta": " 2"})
        flusher().poke()  # a tick is due the moment the write in flight ends
        last = asyncio.create_task(stream.flush())  # the turn's final flush, waiting on that write
        await asyncio.sleep(0.01)
        published.release.set()
        await asyncio.wait_for(last, 5)
        sent = [seq for batch in published.batches for seq, _ in batch]
        assert sent == list(range(stream.next_seq)), "the flush returned with a batch in flight"
        await first
    finally:
        flusher().unregister(stream)
