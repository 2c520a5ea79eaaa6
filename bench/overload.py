"""Overload: hundreds of turns started at once against one worker; none may be lost or duplicated.

N WebSocket clients (one conversation each, one Python asyncio process) connect first, then all send
their chat request at the same moment to one threads-pool worker (`--concurrency`, 256 by default, as
in the Procfile: a turn holds a pool thread while its coroutine runs on the worker's event loop, so with
fewer threads than turns the rest wait in the broker queue). Each turn is `count to K [rate R]` from
the scripted model.

Per turn: completed (the done frame, outcome completed), refused (an error frame; with
`--max-active`, the per-principal limit), or neither. Then the store is read per conversation:
a completed turn must have exactly one assistant answer with the exact text, a refused one nothing
stored (no fiber, no message). Printed: completed / refused (with the error texts) / lost /
duplicated, how many waiting turns were told so (cf_agent_chat_queued) before their first chunk,
time to first token at the client (send -> first chunk) p50/p90/p99/max, total wall time, and the CPU
of the worker, daphne, Postgres, the model and this client. The exit status is 1 when any turn is
lost, duplicated, refused without a clear error, or waited long without a queued frame. Like every
benchmark it asserts no timing.

The stack (scripted model, daphne, beat, one worker) runs on a redis-server of its own and its own
database (thinkproject_overload), so nothing else on the machine takes its turns.

    .venv/bin/python bench/overload.py --turns 500
    .venv/bin/python bench/overload.py --turns 40 --concurrency 4 --principals 4 --max-active 8 \
        --worker-after-accept   # the test's small form: a backlog, so the limit refuses exactly 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/thinkproject_overload")

from harness import logs_done, percentile, progress, scripted_model_process, setup_django  # type: ignore[import-not-found]  # noqa: E402
from soak import use_private_redis  # type: ignore[import-not-found]  # noqa: E402

QUEUED = "cf_agent_chat_queued"
# A turn whose first chunk came this much later than QUEUED_NOTICE_MS must have been told it waited.
TOLD_MARGIN_S = 1.5


@dataclass
class Turn:
    name: str
    principal: str
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    sent_at: float = 0.0
    sent_wall: float = 0.0  # time.time() at the send, to compare with the fiber's claim (Postgres' clock)
    claimed_after: float | None = None  # seconds from the send to a worker's claim of its fiber
    queued_at: float | None = None
    queued_reason: str | None = None
    first_chunk_at: float | None = None
    outcome: str | None = None  # completed, error (refused or failed), or None: no end seen
    error: str = ""
    text: str = ""
    seqs: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.sent_at


async def connect(port: int, turn: Turn, gate: asyncio.Semaphore) -> Any:
    from tests.support import ChatClient

    async with gate:  # a bounded connect storm: the turn storm is what is measured
        client = ChatClient(port, turn.name, principal=turn.principal)
        for attempt in range(5):
            try:
                await client.__aenter__()
                await client.recv_type("cf_agent_identity", timeout=60)
                return client
            except (OSError, TimeoutError):
                await asyncio.sleep(0.5 * (attempt + 1))
        raise RuntimeError(f"{turn.name}: could not connect")


async def run_turn(client: Any, turn: Turn, prompt: str, start: asyncio.Event, budget: float) -> None:
    from tests.support import StreamLog, chat_request, user_message

    await start.wait()
    turn.sent_at, turn.sent_wall = time.monotonic(), time.time()
    await client.send(chat_request(turn.request_id, [user_message(prompt)]))
    log = StreamLog()
    deadline = turn.sent_at + budget
    try:
        while log.done is None:
            frame = await client.recv(max(0.01, deadline - time.monotonic()))
            kind = frame.get("type")
            if kind == QUEUED and frame.get("id") == turn.request_id and turn.queued_at is None:
                turn.queued_at, turn.queued_reason = time.monotonic(), frame.get("reason")
            elif kind == "cf_agent_use_chat_response" and frame.get("id") == turn.request_id:
                log.record(frame)
                if log.chunks and turn.first_chunk_at is None:
                    turn.first_chunk_at = time.monotonic()
    except TimeoutError:
        turn.problems.append(f"no end within {budget:.0f} s")
    finally:
        await client.__aexit__(None, None, None)
    turn.text = log.text
    turn.seqs = [s for s in log.seqs if s is not None]
    if log.done is not None:
        turn.outcome = "error" if log.done.get("error") else log.done.get("outcome", "completed")
        turn.error = "; ".join(log.errors)


def stored(turn: Turn) -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation's transcript and the statuses of its fibers."""
    from chat.models import Conversation
    from chat.transcript.selectors import messages_list
    from recovery.models import Fiber

    conversation = Conversation.objects.filter(agent="assistant", name=turn.name).first()
    if conversation is None:
        return [], []
    rows = list(Fiber.objects.filter(conversation=conversation).values_list("status", "started_at"))
    claims = [started.timestamp() for _, started in rows if started is not None]
    if claims and turn.sent_wall:
        turn.claimed_after = min(claims) - turn.sent_wall
    return messages_list(conversation_id=conversation.pk), [status for status, _ in rows]


def check(turn: Turn, expected: str, notice_s: float) -> None:
    """Lost, duplicated, refused without a clear error, or waited without being told: in turn.problems."""
    from tests.support import assistant_text

    messages, fibers = stored(turn)
    answers = [m for m in messages if m["role"] == "assistant"]
    if len(turn.seqs) != len(set(turn.seqs)):
        turn.problems.append("duplicated: a seq seen twice by the client")
    if turn.outcome == "completed":
        if len(answers) != 1:
            turn.problems.append(
                f"{'duplicated' if answers else 'lost'}: {len(answers)} assistant answers stored"
            )
        elif assistant_text(messages) != expected:
            turn.problems.append(f"lost: stored answer {assistant_text(messages)!r:.60}")
        if turn.text != expected:
            turn.problems.append(f"the client's text differs: {turn.text!r:.60}")
        if fibers != ["completed"]:
            turn.problems.append(f"fibers {fibers}")
        told = (
            turn.queued_at is not None
            and turn.first_chunk_at is not None
            and turn.queued_at < turn.first_chunk_at
        )
        # The notice is owed for a wait for the server or a worker; a turn a worker took at once and
        # whose model was slow to say its first word (a loaded machine) was not queued.
        queued = turn.claimed_after is None or turn.claimed_after > notice_s + TOLD_MARGIN_S
        if (turn.ttft or 0) > notice_s + TOLD_MARGIN_S and not told and queued:
            turn.problems.append(
                f"waited {turn.ttft:.1f} s for its first chunk without a queued frame"
                f" (a worker took it after {turn.claimed_after or 0:.1f} s)"
            )
    elif turn.outcome == "error" and not turn.seqs:  # refused before anything ran
        if messages or fibers:
            turn.problems.append(f"refused, yet stored: {len(messages)} messages, fibers {fibers}")
        if "refused" not in turn.error:
            turn.problems.append(f"refused without a clear error: {turn.error!r}")
    else:
        turn.problems.append(f"lost: ended {turn.outcome!r} {turn.error!r:.80}, stored {fibers}")


async def every_turn_answered(turns: list[Turn], timeout: float = 120) -> None:
    """Wait until each turn is accepted (its fiber is stored) or refused (its client got the error)."""
    from asgiref.sync import sync_to_async

    from recovery.models import Fiber

    names = [t.name for t in turns]

    def accepted() -> int:
        return Fiber.objects.filter(conversation__name__in=names).values("conversation").distinct().count()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        refused = sum(1 for t in turns if t.outcome == "error")
        if await sync_to_async(accepted)() + refused >= len(turns):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"turns still neither accepted nor refused after {timeout:.0f} s")


def is_lost(turn: Turn) -> bool:
    return any(p.startswith("lost") or p.startswith("no end") for p in turn.problems)


def is_duplicated(turn: Turn) -> bool:
    return any(p.startswith("duplicated") for p in turn.problems)


def report(turns: list[Turn], args: argparse.Namespace, wall: float, cpu: dict[str, float]) -> int:
    completed = [t for t in turns if t.outcome == "completed"]
    refused = [t for t in turns if t.outcome == "error" and not t.seqs]
    lost = [t for t in turns if is_lost(t)]
    duplicated = [t for t in turns if is_duplicated(t)]
    problems = [t for t in turns if t.problems]
    waited = [t for t in completed if (t.ttft or 0) > args.notice_ms / 1000 + TOLD_MARGIN_S]
    told = [t for t in completed if t.queued_at is not None]
    ttft = [t.ttft for t in completed if t.ttft is not None]
    print(f"\nturns: {len(turns)} at once, one worker --pool threads --concurrency {args.concurrency}")
    print(f"each: 'count to {args.count} [rate {args.rate}]' ({args.count} tokens at {args.rate}/s)")
    if args.max_active:
        print(f"limit: PRINCIPAL_MAX_ACTIVE_TURNS={args.max_active} over {args.principals} principals")
    print(f"completed: {len(completed)}")
    print(f"refused: {len(refused)}")
    for text, count in Counter(t.error for t in refused).most_common(3):
        print(f"  {count} x {text!r}")
    print(f"lost: {len(lost)}")
    print(f"duplicated: {len(duplicated)}")
    print(f"other problems: {len([t for t in problems if not is_lost(t) and not is_duplicated(t)])}")
    reasons = Counter(t.queued_reason for t in told)
    print(f"told they were queued: {len(told)} of {len(completed)} completed ({dict(reasons)})")
    told_first = sum(1 for t in waited if t.queued_at is not None and t.queued_at < (t.first_chunk_at or 0))
    limit = args.notice_ms / 1000 + TOLD_MARGIN_S
    print(f"  waited > {limit:.1f} s for the first chunk: {len(waited)}, of them told first: {told_first}")
    if ttft:
        print(
            "time to first token at the client (s): "
            f"p50 {percentile(ttft, 50):.2f}, p90 {percentile(ttft, 90):.2f}, "
            f"p99 {percentile(ttft, 99):.2f}, max {max(ttft):.2f} (min {min(ttft):.2f})"
        )
    print(f"wall time, first send -> last end: {wall:.1f} s")
    print("CPU seconds: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu.items()))
    for turn in problems[:10]:
        print(f"  {turn.name}: {'; '.join(turn.problems)}")
    return 1 if problems else 0


async def main(args: argparse.Namespace) -> int:
    import procstat  # type: ignore[import-not-found]

    from tests.support import Proc, start_beat, start_daphne, start_worker

    logs = Path(tempfile.mkdtemp(prefix="thinkoverload-"))
    redis_proc, _ = use_private_redis(logs)
    procs: list[Proc] = [redis_proc]
    os.environ["CHANNELS_PREFIX"] = "overload"
    limits = {"THINK_PRINCIPAL_MAX_ACTIVE_TURNS": str(args.max_active)} if args.max_active else {}
    code = 1
    try:
        setup_django()
        with scripted_model_process(logs, args.rate) as model_url:
            root = str(Path(__file__).parent.parent)
            env = dict(
                os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=root, LOG_LEVEL="WARNING", **limits
            )
            daphne, port = start_daphne({**env, "DJANGO_CONN_MAX_AGE": "600"}, logs)
            procs.append(daphne)
            procs.append(start_beat(env, logs))
            workers: list[Proc] = []

            def start_the_worker() -> None:
                worker = start_worker(env, logs, name="overload-worker", concurrency=args.concurrency)
                procs.append(worker)
                workers.append(worker)

            if not args.worker_after_accept:
                start_the_worker()
            parts = [
                procstat.Part("worker", procstat.trees(lambda: [w.popen.pid for w in workers])),  # type: ignore[union-attr]
                procstat.Part("daphne", procstat.tree(daphne.popen.pid)),  # type: ignore[union-attr]
                procstat.Part("postgres", procstat.postgres_cluster),
                procstat.Part("client", lambda: [os.getpid()]),
            ]
            tag = uuid.uuid4().hex[:6]
            turns = [
                Turn(f"overload-{tag}-{i}", f"bench:user-{i % args.principals}") for i in range(args.turns)
            ]
            progress(f"connecting {len(turns)} clients")
            gate = asyncio.Semaphore(50)
            clients = await asyncio.gather(*(connect(port, t, gate) for t in turns))
            progress("all connected; every client sends its request now")
            start = asyncio.Event()
            prompt = f"count to {args.count} [rate {args.rate}]"
            runs = [
                asyncio.create_task(run_turn(c, t, prompt, start, args.budget))
                for c, t in zip(clients, turns, strict=True)
            ]
            meter = procstat.Meter(parts)
            meter.start()
            began = time.monotonic()
            start.set()
            if args.worker_after_accept:
                await every_turn_answered(turns)
                progress("every turn accepted or refused; the worker starts")
                await asyncio.to_thread(start_the_worker)
            await asyncio.gather(*runs)
            wall = time.monotonic() - began
            cpu = meter.stop()
            progress("all turns ended; reading the store")
            expected = " ".join(str(i) for i in range(1, args.count + 1))
            from asgiref.sync import sync_to_async

            for turn in turns:
                await sync_to_async(check)(turn, expected, args.notice_ms / 1000)
            code = report(turns, args, wall, cpu)
    finally:
        for proc in reversed(procs):
            proc.stop()
    return int(logs_done(logs, code, args.keep_logs))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--turns", type=int, default=500, help="conversations, each starting one turn at once"
    )
    parser.add_argument(
        "--concurrency", type=int, default=256, help="the worker's --concurrency (threads pool)"
    )
    parser.add_argument("--count", type=int, default=60, help="tokens per answer (count to K)")
    parser.add_argument("--rate", type=float, default=20, help="the scripted model's tokens per second")
    parser.add_argument(
        "--principals", type=int, default=0, help="whom the conversations belong to (0: one each)"
    )
    parser.add_argument("--max-active", type=int, default=0, help="PRINCIPAL_MAX_ACTIVE_TURNS (0: no limit)")
    parser.add_argument(
        "--budget", type=float, default=600.0, help="seconds a client waits for its turn's end"
    )
    parser.add_argument("--notice-ms", type=float, default=500.0, help="THINK QUEUED_NOTICE_MS of the stack")
    parser.add_argument(
        "--worker-after-accept",
        action="store_true",
        help="start the worker once every turn is accepted or refused (a backlog: the limits count exactly)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    arguments = parser.parse_args()
    arguments.principals = arguments.principals or arguments.turns
    sys.exit(asyncio.run(main(arguments)))
