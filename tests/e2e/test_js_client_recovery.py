"""The published JavaScript client watching a turn whose worker is SIGKILLed mid-stream.

On recovery_stack (daphne and beat on a queue of their own) with workers this module starts and kills,
so the shared `stack` worker and these never take each other's turns.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from recovery.models import Fiber
from tests.e2e.js_client import (
    RunningScenario,
    frames,
    get_messages,
    new_name,
    node_with_packages,
    tab,
)
from tests.support import assistant_text, numbers

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="session")
def node() -> str:
    """Node.js with tests/js installed (npm ci from the lock file when needed)."""
    return node_with_packages()


@pytest.fixture(autouse=True)
def own_workers(recovery_stack: Any) -> Iterator[None]:
    """The workers a test starts (and kills) never outlive it."""
    yield
    recovery_stack.stop_workers()


def test_the_client_follows_a_recovery_after_the_worker_is_killed(recovery_stack: Any, node: str) -> None:
    worker = recovery_stack.start_worker()
    name = new_name("kill")
    scenario = RunningScenario(
        node,
        recovery_stack.port,
        "assistant",
        name,
        "recovery",
        prompt="count to 60 [rate 25]",
        killAfter=12,
        timeoutMs=60000,
    )
    scenario.wait_event("kill", timeout=30)  # the client has folded 12 numbers
    worker.kill(signal.SIGKILL)
    recovery_stack.start_worker()
    result = scenario.result()

    request_id = result["requestId"]
    me = tab(result)
    first, second = result["first"], result["second"]
    # The first stream ends cleanly: the server closes it for its watchers with outcome "recovering".
    assert result["firstDone"] == {**result["firstDone"], "done": True, "outcome": "recovering"}
    assert not result["firstDone"].get("error") and first["errors"] == []
    assert len(first["text"].split()) >= 12 and numbers(60).startswith(first["text"])
    assert first["text"] != numbers(60)
    assert [f["recovering"] for f in frames(me, "cf_agent_chat_recovering")] == [True, False]

    # A new resume probe picks the continuation up: one ACK, replay then live, every seq once.
    assert result["probes"][-1]["found"] is True and len(result["probes"]) <= 20
    [ack] = [f for f in me["sent"] if f["type"] == "cf_agent_stream_resume_ack"]
    continuation_id = ack["id"]
    assert continuation_id != request_id
    after_ack = [
        f for f in frames(me, "cf_agent_use_chat_response", id=continuation_id) if f["t"] >= ack["t"]
    ]
    # The replay is the whole message under its id: the stored partial as chunks, then the
    # continuation's own stored chunks (its start names no message and is left out of a replay); then
    # the live tail, which extends it (continuation: true). Every seq once, in order.
    replayed = [f for f in after_ack if f.get("replay")]
    live = [f for f in after_ack if not f.get("replay")]
    assert replayed[0]["body"]["type"] == "start"
    assert replayed[0]["body"]["messageId"] == first["message"]["id"]
    assert all(f.get("continuation") for f in live) and not any(f.get("continuation") for f in replayed)
    seqs = [f["seq"] for f in after_ack if isinstance(f.get("body"), dict) and "seq" in f]
    assert seqs[0] <= 1 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert after_ack[-1]["done"] is True and after_ack[-1]["outcome"] == "completed"

    # What the client shows after the resume is the whole answer, every number exactly once.
    assert second["errors"] == []
    assert second["text"] == numbers(60) and second["message"]["id"] == first["message"]["id"]
    transcript = get_messages(recovery_stack.port, "assistant", name)
    assert [m["role"] for m in transcript] == ["user", "assistant"], "the continuation extended the partial"
    assert transcript[1]["id"] == first["message"]["id"], "the answer is stored under the id the client saw"
    assert assistant_text(transcript) == numbers(60)
    fiber = Fiber.objects.get(request_id=request_id)
    assert fiber.status == Fiber.Status.RECOVERED
