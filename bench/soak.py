"""Soak: the worker running a turn is SIGKILLed at a random point, round after round; nothing may be lost.

Each round starts a turn ("count to 80 [rate 40]") through a WebSocket client, SIGKILLs the only worker
at a random point (before the first chunk, mid-stream, near the end, or not at all), starts a new worker
at once, and follows the conversation until the turn finishes. At the end it prints the totals: lost
turns (the stored answer is missing, or misses a number), duplicated chunks (a seq or a number seen twice
by the client, or stored twice), stuck turns (not finished within the budget), and the recovery time
(SIGKILL -> first chunk of the stream that finishes the turn). The exit status is 1 when any of the
three counts is not 0. Like every benchmark it asserts no timing.

The stack (scripted model, daphne, beat, one worker) runs on a redis-server of its own (a free port, no
persistence) and its own database (thinkproject_soak), so nothing else on the machine takes its turns.

    .venv/bin/python bench/soak.py --rounds 12 --seed 7
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/thinkproject_soak")

from harness import logs_done, progress, scripted_model_process, setup_django, summary  # type: ignore[import-not-found]  # noqa: E402

COUNT = 80
PROMPT = f"count to {COUNT} [rate 40]"
EXPECTED = " ".join(str(i) for i in range(1, COUNT + 1))
# Where a round kills the worker, and how often.
MODES = {"none": 0.15, "before first chunk": 0.2, "mid-stream": 0.45, "near the end": 0.2}


@dataclass
class Round:
    mode: str
    seen_at_kill: int | None = None  # numbers the client had when the worker was killed
    recovery_s: float | None = None
    finished: bool = False
    lost: bool = False
    duplicates: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class Seen:
    """What the client saw: frames per stream, and when each stream's first chunk arrived."""

    log: Any
    first_chunk_at: dict[str, float] = field(default_factory=dict)

    def chunks(self) -> int:
        return sum(len(self.log.streams[r].chunks) for r in self.log.order)

    def numbers(self) -> int:
        """Numbers of the answer seen: the kill points count these, since frames carry several
        (deltas of a flush are coalesced into one chunk)."""
        return len(self.log.text.split())


async def follow(client: Any, seen: Seen, until: Any, deadline: float) -> None:
    """tests.support.follow_conversation, noting the arrival of each stream's first chunk."""
    while not until(seen):
        frame = await client.recv(max(0.01, deadline - time.monotonic()))
        if frame.get("type") == "cf_agent_use_chat_response":
            stream = seen.log.stream(frame["id"])
            stream.record(frame)
            if stream.chunks and frame["id"] not in seen.first_chunk_at:
                seen.first_chunk_at[frame["id"]] = time.monotonic()


def stored(name: str) -> tuple[str | None, bool, Any]:
    """(assistant text stored, whether a fiber is still active, the terminal record) of a conversation."""
    from chat.models import Conversation
    from chat.transcript.selectors import messages_list
    from recovery.models import Fiber
    from tests.support import assistant_text

    conversation = Conversation.objects.get(agent="assistant", name=name)
    messages = messages_list(conversation_id=conversation.pk)
    text = assistant_text(messages) if any(m["role"] == "assistant" for m in messages) else None
    active = Fiber.objects.filter(conversation=conversation).active().exists()
    return text, active, conversation.last_terminal


def repeats(text: str) -> int:
    words = text.split()
    return len(words) - len(set(words))


class Stack:
    """daphne and beat for the whole run; the one worker is replaced after every kill."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        from tests.support import start_beat, start_daphne, start_worker

        self.env, self.logs = env, logs
        self.daphne, self.port = start_daphne({**env, "DJANGO_CONN_MAX_AGE": "600"}, logs)
        self.beat = start_beat(env, logs)
        self.worker = start_worker(env, logs, name="soak-worker")

    def new_worker(self) -> Any:
        from tests.support import start_worker

        return start_worker(self.env, self.logs, name="soak-worker")

    def stop(self) -> None:
        for proc in (self.worker, self.beat, self.daphne):
            proc.stop()


async def kill_point(client: Any, seen: Seen, mode: str, rng: random.Random, deadline: float) -> None:
    """Follow the turn until the round's kill point."""
    if mode == "before first chunk":
        delay = time.monotonic() + rng.uniform(0.0, 0.3)
        # Kill at the delay, or at the first chunk if it comes sooner (then 1 chunk was seen).
        try:
            await follow(client, seen, lambda s: s.chunks() >= 1, min(delay, deadline))
        except TimeoutError:
            pass
        return
    low, high = (3, COUNT - 10) if mode == "mid-stream" else (COUNT - 8, COUNT - 2)
    target = rng.randint(low, high)
    await follow(client, seen, lambda s: s.numbers() >= target or s.log.finished, deadline)


async def one_round(stack: Stack, mode: str, rng: random.Random, budget: float) -> Round:
    from tests.support import ChatClient, ConversationLog, chat_request, user_message

    result = Round(mode)
    name = f"soak-{uuid.uuid4().hex[:8]}"
    seen = Seen(ConversationLog())
    replacement: asyncio.Task[Any] | None = None
    killed_at = 0.0
    async with ChatClient(stack.port, name) as client:
        deadline = time.monotonic() + budget
        await client.send(chat_request(uuid.uuid4().hex[:10], [user_message(PROMPT)]))
        try:
            if mode != "none":
                await kill_point(client, seen, mode, rng, deadline)
                result.seen_at_kill = seen.numbers()
                stack.worker.kill(signal.SIGKILL)
                killed_at = time.monotonic()
                replacement = asyncio.create_task(asyncio.to_thread(stack.new_worker))
            await follow(client, seen, lambda s: s.log.finished, deadline)
            result.finished = True
        except TimeoutError:
            result.problems.append(f"not finished within {budget:.0f} s")
        finally:
            if replacement is not None:
                stack.worker = await replacement
    if killed_at and seen.log.order:
        carrier = seen.log.order[-1]  # the stream that finished the turn
        started = seen.first_chunk_at.get(carrier)
        if started is not None and started > killed_at:  # else the turn ended before the kill
            result.recovery_s = started - killed_at
    await check(result, seen, name)
    return result


async def check(result: Round, seen: Seen, name: str) -> None:
    from asgiref.sync import sync_to_async

    for request_id in seen.log.order:
        seqs = seen.log.streams[request_id].seqs
        result.duplicates += len(seqs) - len(set(seqs))
    result.duplicates += repeats(seen.log.text)
    text, active, terminal = await sync_to_async(stored)(name)
    for _ in range(50):  # the fiber settles right after the done frame
        if not active:
            break
        await asyncio.sleep(0.1)
        text, active, terminal = await sync_to_async(stored)(name)
    if active:
        result.finished = False
        result.problems.append("a fiber is still active")
    if terminal:
        result.problems.append(f"ended with the terminal message: {terminal.get('body')!r}")
    if text is None or set(EXPECTED.split()) - set(text.split()):
        result.lost = True
        result.problems.append(f"stored answer incomplete: {text!r:.80}")
    result.duplicates += repeats(text or "")
    if text is not None and text != EXPECTED and not result.lost and not result.duplicates:
        result.duplicates += 1
        result.problems.append(f"stored answer differs: {text!r:.80}")
    if seen.log.text != EXPECTED:
        result.problems.append("the client's text differs from the answer")


def private_redis(logs: Path) -> tuple[Any, str]:
    from tests.support import Proc, free_port, wait_until

    port = free_port()
    args = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1"]
    args += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
    proc = Proc("redis", args, {}, logs / "redis.log").start()

    def up() -> bool:
        import redis

        try:
            return bool(redis.Redis(port=port, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    wait_until(up, 10, "the soak's redis-server")
    return proc, f"redis://127.0.0.1:{port}"


def use_private_redis(logs: Path) -> tuple[Any, str]:
    """A private redis-server, and this process's environment (so the stack it starts) pointed at it."""
    proc, url = private_redis(logs)
    os.environ.update(REDIS_URL=f"{url}/0", CHANNELS_REDIS_URL=f"{url}/1", CACHE_REDIS_URL=f"{url}/2")
    return proc, url


def report(rounds: list[Round], seed: int) -> int:
    kills = [r for r in rounds if r.mode != "none"]
    lost = sum(r.lost for r in rounds)
    duplicates = sum(r.duplicates for r in rounds)
    stuck = sum(not r.finished for r in rounds)
    by_mode = ", ".join(f"{m} {sum(r.mode == m for r in kills)}" for m in MODES if m != "none")
    recoveries = [r.recovery_s for r in rounds if r.recovery_s is not None]
    print(f"\nseed: {seed}")
    print(f"rounds: {len(rounds)}")
    print(f"kills: {len(kills)} ({by_mode}); not killed: {len(rounds) - len(kills)}")
    print(f"lost turns: {lost}")
    print(f"duplicated chunks: {duplicates}")
    print(f"stuck turns: {stuck}")
    if recoveries:
        what = "recovery time (s), SIGKILL -> first chunk of the stream that finished the turn"
        print(f"{what}: {summary(recoveries)}")
    print("settings: LEASE_TTL_S=3.0 tick=1.0 s, one threads-pool worker, replaced at once after each kill")
    return 1 if lost or duplicates or stuck else 0


async def main(args: argparse.Namespace) -> int:
    from tests.support import Proc

    logs = Path(tempfile.mkdtemp(prefix="thinksoak-"))
    redis_proc, _ = use_private_redis(logs)
    procs: list[Proc] = [redis_proc]
    os.environ["CHANNELS_PREFIX"] = "soak"
    rng = random.Random(args.seed)
    rounds: list[Round] = []
    stack: Stack | None = None
    try:
        setup_django()
        with scripted_model_process(logs, 40) as model_url:
            env = dict(os.environ, SCRIPTED_MODEL_URL=model_url, PYTHONPATH=str(Path(__file__).parent.parent))
            stack = Stack(env, logs)
            for n in range(1, args.rounds + 1):
                mode = rng.choices(list(MODES), weights=list(MODES.values()))[0]
                result = await one_round(stack, mode, rng, args.budget)
                rounds.append(result)
                at = "" if result.seen_at_kill is None else f" after {result.seen_at_kill} numbers"
                took = "" if result.recovery_s is None else f", recovered in {result.recovery_s:.2f} s"
                status = "; ".join(result.problems) or "ok"
                progress(f"round {n}/{args.rounds}: kill {mode}{at}{took}: {status}")
    finally:
        if stack is not None:
            stack.stop()
        for proc in procs:
            proc.stop()
    code = report(rounds, args.seed)
    return int(logs_done(logs, code, args.keep_logs))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a new one, printed)")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds a turn may take to finish")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    arguments = parser.parse_args()
    if arguments.seed is None:
        arguments.seed = random.SystemRandom().randrange(1_000_000)
    print(f"seed: {arguments.seed}", flush=True)
    sys.exit(asyncio.run(main(arguments)))
