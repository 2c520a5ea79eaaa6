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
    chunk_seqs,
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
    assert all(f.get("continuation") for f in after_ack)
    assert chunk_seqs(after_ack) == list(range(len(chunk_seqs(after_ack))))
    assert after_ack[-1]["done"] is True and after_ack[-1]["outcome"] == "completed"

    # What the client shows, the partial then the continuation, is every number exactly once.
    assert second["errors"] == []
    assert first["text"] + second["text"] == numbers(60)
    transcript = get_messages(recovery_stack.port, "assistant", name)
    assert [m["role"] for m in transcript] == ["user", "assistant"], "the continuation extended the partial"
    assert transcript[1]["id"] == first["message"]["id"], "the answer is stored under the id the client saw"
    first_chunk = next(f["body"] for f in after_ack if f["body"])
    assert first_chunk == {"type": "start"}, "a continuation names no message"
    assert assistant_text(transcript) == numbers(60)
    fiber = Fiber.objects.get(request_id=request_id)
    assert fiber.status == Fiber.Status.RECOVERED
