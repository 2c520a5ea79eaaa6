"""Concurrency (P4): concurrent streaming turns on one host: latency, and where the CPU goes.

For each level L, L WebSocket clients each start a turn at the same time ("count to N [rate R] [stamp]":
the scripted model stamps every number with its send time), and the latency of every number is measured
at the client: receive time minus send time. Everything runs on this machine (2 cores): Postgres, Redis,
daphne, the worker(s), the scripted model and this client.

Per level it also reads, from /proc, the CPU each part of the stack spent (worker, web, Postgres, Redis,
model, client), per number delivered, and the worker's resident memory above its idle size per active
turn. `--marginal A B` runs each level twice, with A and with B numbers per turn, and divides the
difference by the difference in numbers: the cost of one more streamed number, without what a turn
costs to start and finish. A bare read of the same streams straight from the model (httpx, SSE lines,
one json.loads per event: the least any client can do) gives the unit the pipeline is measured in.

    .venv/bin/python bench/concurrency.py --levels 25 50 100 200
    .venv/bin/python bench/concurrency.py --levels 50 --marginal 40 400
    .venv/bin/python bench/concurrency.py --levels 50 200 --workers 2
    .venv/bin/python bench/concurrency.py --levels 50 200 --wire ws http
    .venv/bin/python bench/concurrency.py --levels 200 --server uvicorn --profile-web /tmp/web

`--server` picks the ASGI server of the web process: daphne (the default, as in the Procfile) or
uvicorn (`--ws websockets`), to compare what the server itself costs under the same load.
`--profile-web PATH` samples the web process with py-spy during each level (collapsed stacks in
PATH.<level>.txt; with BENCH_PROFILE_GIL=1, only the thread holding the GIL: where its Python CPU goes,
not its waits on Postgres) and prints where its time went (bench/profile_summary.py).

Each level also prints the p99 latency of the numbers by the second of the run they were sent in: the
first seconds are those of the turns' starts.

`--wire` names the clients: `ws` (the cf_agent WebSocket, the default) or `http` (the AI SDK's HTTP
chat wire: one POST per turn, its answer an SSE response, read line by line as useChat's transport
reads it). Given both, each level runs once with each, in the same sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import procstat  # type: ignore[import-not-found]
import profile_summary  # type: ignore[import-not-found]
from harness import ROOT, log_dir, percentile, progress, scripted_model_process, setup_django  # type: ignore[import-not-found]

PIPELINE = ("worker", "web", "postgres", "redis")


@dataclass
class Run:
    turns: int
    numbers: int
    completed: int = 0
    delivered: int = 0  # numbers that reached the clients
    latencies: list[float] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)  # each number's send time, as latencies
    elapsed: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # seconds per part
    worker_rss_peak: int = 0

    def per_number_us(self, part: str) -> float:
        return self.cpu.get(part, 0.0) / max(1, self.delivered) * 1e6

    @property
    def pipeline_us(self) -> float:
        return sum(self.per_number_us(p) for p in PIPELINE)


def stamps(delta: str) -> list[float]:
    """The send times of the numbers in one delta ("12@t" or, coalesced, " 12@t 13@t")."""
    found = []
    for piece in delta.split():
        _, at, stamp = piece.partition("@")
        if at:
            found.append(float(stamp))
    return found


def count(chunk: dict[str, Any], now: float, run: Run) -> None:
    if chunk.get("type") == "text-delta":
        sent = stamps(chunk.get("delta", ""))
        run.delivered += len(sent)
        run.latencies.extend(now - t for t in sent)
        run.sent_at.extend(sent)


async def one_turn(port: int, numbers: int, rate: float, run: Run, http: Any = None) -> bool:
    """One turn, sent and followed by a WebSocket client, or by `http` (an httpx client) over the
    HTTP wire."""
    from tests.support import ChatClient, chat_request, user_message

    prompt = f"count to {numbers} [rate {rate}] [stamp]"
    if http is not None:
        return await one_http_turn(http, port, prompt, run)

    async with ChatClient(port, f"cc-{uuid.uuid4().hex[:8]}") as client:
        request_id = uuid.uuid4().hex[:10]
        await client.send(chat_request(request_id, [user_message(prompt)]))
        while True:
            raw = await asyncio.wait_for(client.ws.recv(), 120)
            now = time.time()
            frame = json.loads(raw)
            if frame.get("type") != "cf_agent_use_chat_response" or frame.get("id") != request_id:
                continue
            if frame.get("done"):
                return frame.get("outcome") == "completed"
            count(json.loads(frame["body"]) if frame.get("body") else {}, now, run)


async def one_http_turn(http: Any, port: int, prompt: str, run: Run) -> bool:
    """POST /ai/<agent> as useChat does, its SSE answer read to `data: [DONE]`."""
    from tests.support import auth_headers, user_message

    name = f"cc-{uuid.uuid4().hex[:8]}"
    body = {"id": name, "messages": [user_message(prompt)], "trigger": "submit-message"}
    finished = False
    url = f"http://127.0.0.1:{port}/ai/assistant"
    async with http.stream("POST", url, json=body, headers=auth_headers()) as response:
        if response.status_code != 200:
            raise RuntimeError(f"POST answered {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.time()
            if line == "data: [DONE]":
                return finished
            chunk = json.loads(line[6:])
            finished = finished or chunk.get("type") == "finish"
            count(chunk, now, run)
    return False


async def sample_rss(pids: Any, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        run.worker_rss_peak = max(run.worker_rss_peak, procstat.rss_bytes(pids()))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def level(
    port: int,
    turns: int,
    numbers: int,
    rate: float,
    meter: Any,
    worker_pids: Any,
    wire: str = "ws",
    profile: tuple[int, str] | None = None,
) -> Run:
    """`profile`: (the web process's pid, the file py-spy writes its collapsed stacks to)."""
    import httpx

    run = Run(turns, numbers)
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(worker_pids, run, stop))
    limits = httpx.Limits(max_connections=turns + 10, max_keepalive_connections=turns + 10)
    spy = None
    if profile is not None:
        pid, path = profile
        spy = await asyncio.create_subprocess_exec(
            str(ROOT / ".venv" / "bin" / "py-spy"),
            "record",
            "--pid",
            str(pid),
            "--rate",
            "250",
            "--format",
            "raw",
            "--output",
            path,
            "--nonblocking",
            *(["--gil"] if os.environ.get("BENCH_PROFILE_GIL") else []),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        http = client if wire == "http" else None
        meter.start()
        started = time.monotonic()
        results = await asyncio.gather(
            *(one_turn(port, numbers, rate, run, http) for _ in range(turns)), return_exceptions=True
        )
        run.elapsed = time.monotonic() - started
        run.cpu = meter.stop()
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        await spy.wait()
    stop.set()
    await sampler
    run.completed = sum(1 for r in results if r is True)
    for failure in {repr(r) for r in results if isinstance(r, BaseException)}:
        progress(f"  a turn failed at the client: {failure}")
    return run


async def bare_read(model_url: str, turns: int, numbers: int, rate: float, meter: Any) -> Run:
    """The same streams read straight from the model: SSE lines, one json.loads per event."""
    import httpx

    run = Run(turns, numbers)

    async def one(client: httpx.AsyncClient) -> bool:
        body = {
            "model": "scripted",
            "stream": True,
            "messages": [{"role": "user", "content": f"count to {numbers} [rate {rate}] [stamp]"}],
        }
        async with client.stream("POST", f"{model_url}/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    run.delivered += len(stamps((choice.get("delta") or {}).get("content") or ""))
        return True

    limits = httpx.Limits(max_connections=turns + 10, max_keepalive_connections=turns + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        meter.start()
        started = time.monotonic()
        results = await asyncio.gather(*(one(client) for _ in range(turns)), return_exceptions=True)
        run.elapsed = time.monotonic() - started
        run.cpu = meter.stop()
    run.completed = sum(1 for r in results if r is True)
    return run


def report(label: str, run: Run, bare: Run | None, idle_rss: int) -> None:
    p50, p99 = percentile(run.latencies, 50) * 1000, percentile(run.latencies, 99) * 1000
    parts = "  ".join(f"{name} {run.per_number_us(name):.0f}" for name in run.cpu)
    memory = (run.worker_rss_peak - idle_rss) / max(1, run.turns) / 2**20
    line = (
        f"{label}: {run.completed}/{run.turns} completed, {run.delivered} numbers, p50 {p50:.0f} ms, "
        f"p99 {p99:.0f} ms, {run.elapsed:.1f} s; CPU us per number: {parts}; pipeline {run.pipeline_us:.0f}"
    )
    if bare is not None:
        line += f" = {run.pipeline_us / max(bare.per_number_us('client'), 1e-9):.1f}x a bare read"
    print(f"{line}; worker memory {memory:.2f} MB per turn above idle", flush=True)
    if run.sent_at:
        print(f"  {by_send_time(run)}", flush=True)


def by_send_time(run: Run) -> str:
    """p99 latency of the numbers by the second of the run they were sent in: the first seconds are those
    of the turns' starts."""
    start = min(run.sent_at)
    seconds: dict[int, list[float]] = {}
    for at, latency in zip(run.sent_at, run.latencies, strict=True):
        seconds.setdefault(min(int(at - start), 5), []).append(latency)
    return "p99 by second sent: " + ", ".join(
        f"{'5+' if second == 5 else second} s {percentile(values, 99) * 1000:.0f} ms (n {len(values)})"
        for second, values in sorted(seconds.items())
    )


async def main(args: argparse.Namespace) -> None:
    setup_django()
    from tests.support import start_daphne, start_worker

    with log_dir() as logs, scripted_model_process(logs, args.rate) as model_url:
        env = dict(os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=str(ROOT))
        web_env = {**env, "DJANGO_CONN_MAX_AGE": "600"}
        daphne, port = (
            start_uvicorn(web_env, logs) if args.server == "uvicorn" else start_daphne(web_env, logs)
        )
        workers = []
        model_pid = next(p for p in procstat.tree_pids(os.getpid()) if _is_model(p))
        try:
            for _ in range(args.workers):
                workers.append(start_worker(env, logs, name="cc-worker", concurrency=args.threads))
            worker_pids = procstat.trees(lambda: [w.popen.pid for w in workers])
            meter = procstat.Meter(
                [
                    procstat.Part("worker", worker_pids),
                    procstat.Part("web", procstat.tree(daphne.popen.pid)),
                    procstat.Part("postgres", procstat.postgres_cluster),
                    procstat.Part("redis", lambda: procstat.pids_named("redis-server")),
                    procstat.Part("model", procstat.tree(model_pid)),
                    procstat.Part("client", lambda: [os.getpid()]),
                ]
            )
            for wire in args.wire:
                await level(port, 2, 10, args.rate, meter, worker_pids, wire)  # warm-up
            await asyncio.sleep(1)
            idle_rss = procstat.rss_bytes(worker_pids())
            lengths = args.marginal or [args.numbers]
            for turns in args.levels:
                for wire in args.wire:
                    runs = []
                    for numbers in lengths:
                        bare = await bare_read(model_url, turns, numbers, args.rate, meter)
                        label = f"{args.server} {wire}: {turns} turns x {numbers} numbers"
                        profile = None
                        if args.profile_web:
                            path = f"{args.profile_web}.{wire}-{turns}x{numbers}.txt"
                            profile = (daphne.popen.pid, path)
                        run = await level(port, turns, numbers, args.rate, meter, worker_pids, wire, profile)
                        report(label, run, bare, idle_rss)
                        if profile is not None:
                            print(profile_summary.summary(Path(profile[1])), flush=True)
                        print(
                            f"  bare read of the same streams: client {bare.per_number_us('client'):.1f} us, "
                            f"model {bare.per_number_us('model'):.1f} us per number",
                            flush=True,
                        )
                        runs.append((run, bare))
                        await asyncio.sleep(2)  # let the last turns' finishing work settle
                    if len(runs) == 2:
                        marginal(f"{wire}: {turns}", runs[0], runs[1])
        finally:
            for proc in [daphne, *workers]:
                proc.stop()
    print(f"\n{args.workers} worker process(es) x {args.threads} threads, at {args.rate} numbers/s per turn")


def marginal(turns: str, short: tuple[Run, Run], long: tuple[Run, Run]) -> None:
    (a, bare_a), (b, bare_b) = short, long
    extra = max(1, b.delivered - a.delivered)
    per = {name: (b.cpu[name] - a.cpu.get(name, 0.0)) / extra * 1e6 for name in b.cpu}
    bare = (bare_b.cpu["client"] - bare_a.cpu["client"]) / max(1, bare_b.delivered - bare_a.delivered) * 1e6
    pipeline = sum(per[p] for p in PIPELINE)
    parts = "  ".join(f"{name} {value:.0f}" for name, value in per.items())
    print(
        f"marginal, {turns} turns ({a.numbers} vs {b.numbers} numbers): CPU us per extra number: {parts}; "
        f"pipeline {pipeline:.0f} us = {pipeline / max(bare, 1e-9):.1f}x a bare read ({bare:.1f} us)",
        flush=True,
    )
    # What a turn costs to start and finish: the short run's CPU less its numbers at the marginal cost.
    per_turn = {
        name: (a.cpu[name] - per[name] * a.delivered / 1e6) / max(1, a.turns) * 1000 for name in a.cpu
    }
    print("  CPU per turn, start and finish (ms): " + "  ".join(f"{n} {v:.1f}" for n, v in per_turn.items()))


def start_uvicorn(env: dict[str, str], logs: Path) -> tuple[Any, int]:
    """The web process under uvicorn (its `websockets` implementation) instead of daphne."""
    from tests.support import free_port, start_listening

    port = free_port()
    args = [
        str(ROOT / ".venv" / "bin" / "uvicorn"),
        "thinkproject.asgi:application",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ws",
        "websockets",
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    return start_listening("uvicorn", args, env, logs / f"uvicorn-{port}.log", port), port


def _is_model(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"think_scripted.server" in f.read()
    except OSError:
        return False


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[25, 50, 100, 200])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=256)
    parser.add_argument("--numbers", type=int, default=100)
    parser.add_argument("--marginal", type=int, nargs=2, metavar=("SHORT", "LONG"))
    parser.add_argument("--rate", type=float, default=20)
    parser.add_argument("--wire", nargs="+", choices=["ws", "http"], default=["ws"])
    parser.add_argument("--server", choices=["daphne", "uvicorn"], default="daphne")
    parser.add_argument("--profile-web", metavar="PATH", help="py-spy the web process into PATH.<level>.txt")
    asyncio.run(main(parser.parse_args()))
