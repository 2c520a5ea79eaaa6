"""Reattach vs continue: what a recovered turn costs at the provider when its worker is SIGKILLed.

An agent with `model_reattach` (tests.agents.ReattachAgent, `reattach-agent` in tests/settings.py) calls
the model through the Responses API in background mode; when its worker dies mid-answer, the recovered
turn rejoins the provider's stored generation after the last stored event ("reattach"). When the
provider no longer has the response (`[forget]` in the prompt: the rejoin is a 404), the turn falls back
to "continue": a new generation asked to continue the partial answer.

Each round starts a turn "count to N [rate R]" on a fresh conversation, SIGKILLs the only worker once K
numbers reached the client (a frame carries several), starts a new worker at once and follows the
conversation to the end. Mode "reattach" sends the prompt as is, mode "continue" adds `[forget]`. The
scripted model runs in this process (ScriptedModelServer), so its counters give, per recovered turn, the
generations started and the output tokens generated (the answer itself is N tokens). Per mode it prints
those, their ratio to N, the recovery time (SIGKILL -> first chunk of the stream that finished the
turn), and how many rounds ended with a text (the client's or the stored one) other than exactly `1 ..
N`. It asserts nothing.

The stack (daphne, beat, one threads-pool worker, DJANGO_SETTINGS_MODULE=tests.settings) runs on a
redis-server of its own and its own database (thinkproject_reattach), as bench/soak.py does.

    .venv/bin/python bench/reattach.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/thinkproject_reattach")
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"  # reattach-agent, and the tests' access tokens
os.environ.setdefault("THINK_TEST_RUN_ID", f"bench{uuid.uuid4().hex[:6]}")

from harness import ROOT, percentile, progress, setup_django, summary  # type: ignore[import-not-found]  # noqa: E402
from soak import Seen, follow, use_private_redis  # type: ignore[import-not-found]  # noqa: E402

AGENT = "reattach-agent"
MODES = ("reattach", "continue")


@dataclass
class Round:
    mode: str
    seen_at_kill: int = 0
    generations: int = 0
    tokens: dict[str, int] = field(default_factory=dict)  # response id -> output tokens generated
    recovery_s: float | None = None
    worker_start_s: float = 0.0  # SIGKILL -> the replacement worker ready
    mismatch: list[str] = field(default_factory=list)


class Stack:
    """daphne and beat for the whole run; the one worker is replaced after every kill."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        from tests.support import start_beat, start_daphne

        self.env, self.logs = env, logs
        self.daphne, self.port = start_daphne({**env, "DJANGO_CONN_MAX_AGE": "600"}, logs)
        self.beat = start_beat(env, logs)
        self.worker = self.new_worker()

    def new_worker(self) -> Any:
        from tests.support import start_worker

        return start_worker(self.env, self.logs, name="reattach-worker")

    def stop(self) -> None:
        for proc in (self.worker, self.beat, self.daphne):
            proc.stop()


def stored_text(name: str) -> tuple[str, bool]:
    """(assistant text stored, whether a fiber of the conversation is still active)."""
    from chat.transcript.selectors import conversation_get, messages_list
    from recovery.models import Fiber
    from tests.support import assistant_text

    conversation = conversation_get(agent=AGENT, name=name)
    if conversation is None:
        return "", False
    active = Fiber.objects.filter(conversation_id=conversation.pk).active().exists()
    return assistant_text(messages_list(conversation_id=conversation.pk)), active


async def settled(server: Any, timeout: float = 30) -> None:
    """Wait until the scripted model has no generation running (a forgotten one runs to its end)."""
    from think_scripted.responses import RESPONSES_KEY

    deadline = time.monotonic() + timeout
    while server.app[RESPONSES_KEY].tasks and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def one_round(stack: Stack, server: Any, mode: str, args: argparse.Namespace) -> Round:
    from asgiref.sync import sync_to_async

    from tests.support import ChatClient, ConversationLog, chat_request, numbers, user_message

    result = Round(mode)
    prompt = f"count to {args.count} [rate {args.rate:g}]" + (" [forget]" if mode == "continue" else "")
    name = f"reattach-{uuid.uuid4().hex[:8]}"
    seen = Seen(ConversationLog())
    await settled(server)
    before, created = set(server.response_output_tokens), server.responses_created
    async with ChatClient(stack.port, name, agent=AGENT) as client:
        deadline = time.monotonic() + args.budget
        request_id = uuid.uuid4().hex[:10]
        await client.send(chat_request(request_id, [user_message(prompt)]))
        await follow(
            client,
            seen,
            lambda s: s.numbers() >= args.kill_after,
            deadline,  # frames carry several
        )
        result.seen_at_kill = seen.numbers()
        stack.worker.kill(signal.SIGKILL)
        killed_at = time.monotonic()
        replacement = asyncio.create_task(asyncio.to_thread(stack.new_worker))
        replacement.add_done_callback(
            lambda _: setattr(result, "worker_start_s", time.monotonic() - killed_at)
        )
        try:
            await follow(client, seen, lambda s: s.log.finished, deadline)
        finally:
            stack.worker = await replacement
    carrier = seen.log.order[-1]  # the stream that finished the turn
    started = seen.first_chunk_at.get(carrier)
    if carrier != request_id and started is not None:
        result.recovery_s = started - killed_at
    await settled(server)
    result.generations = server.responses_created - created
    result.tokens = {rid: n for rid, n in server.response_output_tokens.items() if rid not in before}
    expected = numbers(args.count)
    text, active = await sync_to_async(stored_text)(name)
    for _ in range(50):  # the fiber settles right after the done frame
        if not active:
            break
        await asyncio.sleep(0.1)
        text, active = await sync_to_async(stored_text)(name)
    if seen.log.text != expected:
        result.mismatch.append(f"client text {seen.log.text!r:.60}")
    if text != expected:
        result.mismatch.append(f"stored text {text!r:.60}")
    return result


def report(rounds: list[Round], count: int) -> None:
    per_turn: dict[str, float] = {}
    print()
    for mode in MODES:
        done = [r for r in rounds if r.mode == mode]
        if not done:
            continue
        tokens = [float(sum(r.tokens.values())) for r in done]
        per_turn[mode] = statistics.fmean(tokens)
        recoveries = [r.recovery_s for r in done if r.recovery_s is not None]
        generations = statistics.fmean(r.generations for r in done)
        mismatches = sum(bool(r.mismatch) for r in done)
        print(f"mode {mode}:")
        killed_at = statistics.fmean(r.seen_at_kill for r in done)
        print(f"  rounds: {len(done)} (worker SIGKILLed after {killed_at:.0f} numbers on average)")
        print(f"  generations started per recovered turn: {generations:.2f}")
        print(
            f"  output tokens generated per recovered turn: {per_turn[mode]:.1f}"
            f" (min {min(tokens):.0f}, max {max(tokens):.0f}; the answer is {count})"
        )
        print(f"  tokens / N: {per_turn[mode] / count:.2f}")
        if recoveries:
            what = "recovery time (s), SIGKILL -> first chunk of the stream that finished the turn"
            print(f"  {what}: p50 {percentile(recoveries, 50):.2f} ({summary(recoveries)})")
        else:
            print("  recovery time: no recovered stream")
        starts = [r.worker_start_s for r in done]
        print(
            f"  SIGKILL -> replacement worker ready (s): p50 {percentile(starts, 50):.2f} ({summary(starts)})"
        )
        print(f"  final text not exactly '1 .. {count}': {mismatches} of {len(done)}")
    if "reattach" in per_turn and "continue" in per_turn and per_turn["reattach"]:
        ratio = per_turn["continue"] / per_turn["reattach"]
        print(f"\ntokens per recovered turn, continue / reattach: {ratio:.2f}x")
    print("settings: LEASE_TTL_S=3.0 tick=1.0 s, one threads-pool worker, replaced at once after each kill")


async def main(args: argparse.Namespace) -> None:
    from tests.support import Proc, stack_env
    from think_scripted.server import ScriptedModelServer

    logs = Path(tempfile.mkdtemp(prefix="thinkreattach-"))
    redis_proc, redis_url = use_private_redis(logs)
    procs: list[Proc] = [redis_proc]
    os.environ["THINK_TEST_REDIS_URL"] = redis_url  # tests.settings: broker /14, cache /13, channel layer /15
    os.environ["THINK_TEST_DATABASE_NAME"] = os.environ["BENCH_DATABASE_URL"].rsplit("/", 1)[1]
    rounds: list[Round] = []
    stack: Stack | None = None
    server = ScriptedModelServer(token_rate=args.rate)
    try:
        setup_django()
        logging.getLogger("think_scripted.server").setLevel(logging.WARNING)  # its request lines
        server.start()
        env = stack_env(database_name=os.environ["THINK_TEST_DATABASE_NAME"], model_url=server.url)
        env["PYTHONPATH"] = str(ROOT)
        stack = Stack(env, logs)
        for mode in MODES:
            for n in range(1, args.rounds + 1):
                result = await one_round(stack, server, mode, args)
                rounds.append(result)
                took = "" if result.recovery_s is None else f", recovered in {result.recovery_s:.2f} s"
                took += f" (new worker ready in {result.worker_start_s:.2f} s)"
                tokens = "+".join(str(t) for t in result.tokens.values())
                status = "; ".join(result.mismatch) or "text ok"
                progress(
                    f"{mode} round {n}/{args.rounds}: killed after {result.seen_at_kill} numbers{took}, "
                    f"{result.generations} generation(s), {tokens} tokens: {status}"
                )
    finally:
        if stack is not None:
            stack.stop()
        server.stop()
        for proc in procs:
            proc.stop()
    report(rounds, args.count)
    if args.keep_logs:
        print(f"logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per mode")
    parser.add_argument("--count", type=int, default=200, help="N: the turn is 'count to N'")
    parser.add_argument("--rate", type=float, default=50, help="tokens/s of the scripted model")
    parser.add_argument("--kill-after", type=int, default=60, help="K: numbers at the client before SIGKILL")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds a turn may take to finish")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    arguments = parser.parse_args()
    if not 0 < arguments.kill_after < arguments.count:
        sys.exit("--kill-after must be between 1 and --count - 1")
    asyncio.run(main(arguments))
