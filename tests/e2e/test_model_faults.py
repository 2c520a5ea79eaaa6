"""Model faults with real processes: the scripted model answers 429, 5xx, a malformed stream or a reset
connection, and the turn either completes (recovery continues it from what was stored) or, when the model
keeps failing, ends with the terminal message within the budget. Nothing stored is lost either way."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from recovery.models import Fault, Fiber, Incident, Segment
from tests.agents import probe_key, probe_redis
from tests.support import (
    ChatClient,
    ConversationLog,
    assistant_text,
    chat_request,
    follow_conversation,
    numbers,
    user_message,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TERMINAL = "Sorry: the model kept failing."  # tests.agents.FlakyModelAgent


@pytest.fixture(scope="module")
def faults_stack(recovery_stack: Any) -> Iterator[Any]:
    """daphne, beat (a delayed recovery is an alarm the tick fires) and one worker nobody kills."""
    recovery_stack.start_worker()
    yield recovery_stack
    recovery_stack.stop_workers()


def new_name(tag: str) -> str:
    return f"fault-{tag}-{uuid.uuid4().hex[:8]}"


async def run_turn(stack: Any, agent: str, name: str, text: str) -> tuple[str, ConversationLog]:
    """Send one user message and follow the conversation until a turn completes or errors."""
    request_id = uuid.uuid4().hex[:10]
    async with ChatClient(stack.port, name, agent=agent) as client:
        await client.send(chat_request(request_id, [user_message(text)]))
        log = await follow_conversation(client, timeout=60)
    return request_id, log


def stored(agent: str, name: str) -> list[dict[str, Any]]:
    from chat.transcript.selectors import conversation_get, messages_list

    conversation = conversation_get(agent=agent, name=name)
    assert conversation is not None
    return messages_list(conversation_id=conversation.pk)


async def model_calls(name: str) -> int:
    """Model calls made for the conversation: one per turn (a fiber), as each makes one model step."""
    return await Fiber.objects.filter(conversation__name=name).acount()


def assert_clean(log: ConversationLog, expected: str) -> None:
    """Every stream's seqs contiguous from 0 (no gap, no duplicate) and the text exactly as expected."""
    for request_id in log.order:
        seqs = log.streams[request_id].seqs
        assert seqs == list(range(len(seqs))), f"stream {request_id} has a gap or duplicate: {seqs}"
    assert log.text == expected
    assert [e for r in log.order for e in log.streams[r].errors] == [], "no error reaches the client"


MID_STREAM = ["user", "assistant"]  # the stored partial, extended by the continuation
RETRIED = ["user", "assistant"]  # nothing came before the fault: the same user turn is run again
# A 429 in the middle of a stream is an SSE error event: litellm's Chat Completions path keeps no status
# for it (so it is transient), its Responses API path does.
EITHER = {"transient", "rate_limit"}


@pytest.mark.parametrize(
    ("fault", "roles", "interruption"),
    [
        ("[fail after 5 with 429 once]", MID_STREAM, EITHER),
        ("[malformed after 5 once]", MID_STREAM, {"transient"}),
        ("[reset after 5 once]", MID_STREAM, {"transient"}),
        ("[eof after 5 once]", MID_STREAM, {"transient"}),
        ("[fail after 0 with 429 once]", RETRIED, {"rate_limit"}),
        ("[fail after 0 with 500 once]", RETRIED, {"transient"}),
        ("[reset after 0 once]", RETRIED, {"transient"}),
    ],
)
async def test_a_fault_the_model_does_not_repeat_is_recovered_with_the_exact_text(
    faults_stack: Any, fault: str, roles: list[str], interruption: set[str]
) -> None:
    name = new_name("once")
    request_id, log = await run_turn(faults_stack, "assistant", name, f"count to 30 {fault} {name}")
    assert len(log.order) == 2, "the failed turn, then the recovery that finished it"
    first = log.streams[request_id].done
    assert first is not None and first["outcome"] == "recovering" and not first.get("error")
    assert_clean(log, numbers(30))
    assert True in log.recovering and log.recovering[-1] is False
    transcript = await sync_to_async(stored)("assistant", name)
    assert [m["role"] for m in transcript] == roles
    assert assistant_text(transcript) == numbers(30)
    assert await model_calls(name) == 2
    statuses = [i.status async for i in Incident.objects.filter(conversation__name=name)]
    assert statuses == ["completed"], "one incident, kept as the audit of a completed recovery"
    interrupted = await Fiber.objects.aget(request_id=request_id)
    assert interrupted.interruption in interruption


async def test_a_model_failing_mid_stream_every_time_still_finishes_while_it_progresses(
    faults_stack: Any,
) -> None:
    name = new_name("progress")
    _, log = await run_turn(
        faults_stack, "flaky-model-agent", name, f"count to 10 [fail after 4 with 500 always] {name}"
    )
    assert len(log.order) == 3, "1-4, then 5-8 before failing again, then 9-10"
    assert_clean(log, numbers(10))
    transcript = await sync_to_async(stored)("flaky-model-agent", name)
    assert [m["role"] for m in transcript] == ["user", "assistant"], "each continuation extended it"
    assert assistant_text(transcript) == numbers(10)


async def test_a_model_that_always_fails_ends_with_the_terminal_message_within_the_budget(
    faults_stack: Any,
) -> None:
    name = new_name("always")
    request_id, log = await run_turn(
        faults_stack, "flaky-model-agent", name, f"count to 12 [fail after 0 with 500 always] {name}"
    )
    errors = [e for r in log.order for e in log.streams[r].errors]
    assert errors == [TERMINAL], "the terminal message, once, and never the provider's raw error"
    assert log.text == ""
    assert await model_calls(name) >= 2, "it was retried before giving up"
    exhausted = [json.loads(v) for v in probe_redis().lrange(probe_key("exhausted", request_id), 0, -1)]
    assert [e["reason"] for e in exhausted] == ["no_progress_timeout"]
    incident = await Incident.objects.aget(conversation__name=name)
    assert incident.status == "exhausted"
    transcript = await sync_to_async(stored)("flaky-model-agent", name)
    assert [(m["role"], m["parts"][0]["text"]) for m in transcript] == [
        ("user", f"count to 12 [fail after 0 with 500 always] {name}")
    ], "the user message stays; the terminal message is never written into the transcript"


async def test_a_refused_request_ends_the_turn_at_once(
    faults_stack: Any,
) -> None:
    name = new_name("fatal")
    request_id, log = await run_turn(
        faults_stack, "assistant", name, f"count to 9 [fail after 0 with 401] {name}"
    )
    assert log.order == [request_id]
    (error,) = log.streams[request_id].errors
    assert re.fullmatch(PUBLIC.format(r"The model provider rejected the request"), error), error
    fault = await Fault.objects.aget(conversation__name=name)
    assert fault.kind == "provider" and "AuthenticationError" in fault.error_class
    assert await model_calls(name) == 1
    assert await Incident.objects.filter(conversation__name=name).acount() == 0
    transcript = await sync_to_async(stored)("assistant", name)
    assert [m["role"] for m in transcript] == ["user"]


async def test_an_agent_with_chat_recovery_off_ends_the_turn_with_the_error_and_keeps_the_partial(
    faults_stack: Any,
) -> None:
    name = new_name("off")
    request_id, log = await run_turn(
        faults_stack, "no-model-recovery-agent", name, f"count to 9 [fail after 3 with 500 once] {name}"
    )
    assert log.order == [request_id]
    stream = log.streams[request_id]
    assert stream.text == numbers(3) and len(stream.errors) == 1
    assert re.fullmatch(PUBLIC.format("The model provider failed"), stream.errors[0]), stream.errors[0]
    assert await model_calls(name) == 1
    transcript = await sync_to_async(stored)("no-model-recovery-agent", name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert assistant_text(transcript) == numbers(3)


# What a client reads of a provider error: its class, and the reference of the fault that holds the rest.
PUBLIC = r"{} \(error ([0-9a-f]{{8}})\)"
INTERNAL = "upstream http://vllm.internal:8000/v1 via proxy 10.0.0.7 failed"


async def stored_everywhere(name: str) -> str:
    """Everything stored about the conversation a client can be sent: messages, the recorded terminal
    error, the streams' buffered frames, the fibers' error."""

    def read() -> str:
        from chat.models import Conversation

        conversation = Conversation.objects.get(name=name)
        parts = [json.dumps(stored(conversation.agent, name)), json.dumps(conversation.last_terminal)]
        parts += [s.body for s in Segment.objects.filter(stream__conversation=conversation)]
        parts += [f.error for f in Fiber.objects.filter(conversation=conversation)]
        return "\n".join(parts)

    return await sync_to_async(read)()


@pytest.mark.parametrize(
    ("agent", "fault", "public", "partial"),
    [
        ("assistant", "[fail after 0 with 400]", "The model provider rejected the request", ""),
        ("no-model-recovery-agent", "[fail after 3 with 500 once]", "The model provider failed", numbers(3)),
    ],
)
async def test_a_provider_error_body_reaches_no_client(
    faults_stack: Any, agent: str, fault: str, public: str, partial: str
) -> None:
    """Issue 34 row 12: the provider's error body names an internal host. Clients (the live frames and
    the stored transcript they are sent) get a generic text and an id; the Fault row and the worker's
    log under that id hold the body."""
    name = new_name("body")
    prompt = f"count to 9 {fault} [error says {INTERNAL}] {name}"  # the user's own words hold it too
    request_id, log = await run_turn(faults_stack, agent, name, prompt)
    (error,) = log.streams[request_id].errors
    match = re.fullmatch(PUBLIC.format(public), error)
    assert match, error
    reference = match.group(1)
    assert log.streams[request_id].text == partial
    everything = (await stored_everywhere(name)).replace(prompt, "")
    assert "vllm.internal" not in everything and "10.0.0.7" not in everything
    assert error in everything, "the generic text is what is stored for late clients"
    async with ChatClient(faults_stack.port, name, agent=agent) as late:  # a client that comes back
        await late.send({"type": "cf_agent_stream_resume_request"})
        with contextlib.suppress(TimeoutError):
            while True:
                frame = await late.recv(timeout=1.5)
                if frame.get("type") == "cf_agent_stream_resuming":
                    await late.send({"type": "cf_agent_stream_resume_ack", "id": frame["id"]})
    replayed = json.dumps(late.frames).replace(prompt, "")
    assert "vllm.internal" not in replayed and reference in replayed, "the replay carries the generic text"

    fault_row = await Fault.objects.aget(conversation__name=name)
    assert fault_row.id.hex.startswith(reference) and fault_row.kind == "provider"
    assert INTERNAL in fault_row.text and fault_row.request_id == request_id and fault_row.traceback
    worker_log = "".join(w.log() for w in faults_stack.workers)
    assert f"provider fault {reference}" in worker_log and INTERNAL in worker_log
