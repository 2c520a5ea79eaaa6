"""The core scenarios through litellm's Anthropic and Gemini code paths: a stack whose worker's model is
the scripted model speaking that provider's dialect (think_scripted.dialects), so the requests,
event shapes, tool-call deltas, usage fields and error bodies are each provider's own."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from chat.models import Compaction, Conversation
from chat.transcript.files import file_id_of
from recovery.models import Fiber
from tests.agents import tool_runs
from tests.conftest import Stack
from tests.files import PDF, described, file_part, png
from tests.support import (
    FILLER,
    ChatClient,
    ConversationLog,
    assistant_text,
    chat_request,
    follow_conversation,
    numbers,
    seed,
    user_message,
)
from think_scripted.server import message_text

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PNG = png()

DIALECTS = ["anthropic", "gemini"]
CLIENT_TOOLS = [
    {
        "name": "get_location",
        "description": "The user's location, from the browser.",
        "parameters": {"type": "object", "properties": {"tag": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module", params=DIALECTS)
def dialect_stack(request: Any, stack_environment: dict[str, str], log_dir: Path) -> Iterator[Stack]:
    """daphne, beat and one worker whose model speaks `request.param`, on a queue of their own."""
    dialect = request.param
    env = {**stack_environment, "SCRIPTED_MODEL_DIALECT": dialect, "THINK_TEST_QUEUE_SUFFIX": f"-{dialect}"}
    stack = Stack(env, log_dir)
    stack.dialect = dialect  # type: ignore[attr-defined]
    stack.start_beat()
    stack.start_worker()
    yield stack
    stack.stop()


def new_name(stack: Any, tag: str) -> str:
    return f"{stack.dialect[:3]}-{tag}-{uuid.uuid4().hex[:8]}"


def tool_prompt(name: str, **arguments: Any) -> str:
    return f"[tool {name} {json.dumps(arguments)}]"


async def turn(stack: Any, agent: str, name: str, text: str, **extra: Any) -> tuple[str, ConversationLog]:
    """One user message, followed (recoveries included) until a turn completes or errors."""
    request_id = uuid.uuid4().hex[:10]
    async with ChatClient(stack.port, name, agent=agent) as client:
        await client.send(chat_request(request_id, [user_message(text)], **extra))
        log = await follow_conversation(client, timeout=60)
    return request_id, log


async def transcript(agent: str, name: str) -> list[dict[str, Any]]:
    from chat.transcript.selectors import messages_list

    conversation = await Conversation.objects.aget(agent=agent, name=name)
    return await sync_to_async(messages_list)(conversation_id=conversation.pk)


def tool_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for m in messages for p in m["parts"] if str(p.get("type", "")).startswith("tool-")]


def assert_clean(log: ConversationLog, expected: str) -> None:
    for request_id in log.order:
        seqs = log.streams[request_id].seqs
        assert seqs == list(range(len(seqs))), f"stream {request_id} has a gap or duplicate: {seqs}"
    assert [e for r in log.order for e in log.streams[r].errors] == [], "no error reaches the client"
    assert log.text == expected


def last_done(log: ConversationLog) -> dict[str, Any]:
    done = log.streams[log.order[-1]].done
    assert done is not None
    return done


async def test_a_turn_streams_with_the_dialects_usage(dialect_stack: Any, scripted_model: Any) -> None:
    name = new_name(dialect_stack, "stream")
    prompt = f"count to 12 {name}"
    request_id, log = await turn(dialect_stack, "assistant", name, prompt)
    assert log.order == [request_id] and last_done(log)["outcome"] == "completed"
    assert_clean(log, numbers(12))
    finish = next(c for _, c in log.streams[request_id].chunks if c["type"] == "finish")
    [chat] = [c for c in scripted_model.chats if c[-1].get("content") == prompt]
    # The usage from the dialect's own fields (message_start and message_delta, usageMetadata).
    usage = finish["messageMetadata"]["usage"]
    assert usage["completionTokens"] == 12 and usage["promptTokens"] > 0
    assert chat[0] == {"role": "system", "content": "You are a helpful assistant."}
    stored = await transcript("assistant", name)
    assert [m["role"] for m in stored] == ["user", "assistant"] and assistant_text(stored) == numbers(12)


async def test_a_server_tool(dialect_stack: Any) -> None:
    name = new_name(dialect_stack, "tool")
    t = f"tag-{uuid.uuid4().hex[:8]}"
    _, log = await turn(dialect_stack, "tool-agent", name, tool_prompt("add", tag=t, a=2, b=3))
    assert last_done(log)["outcome"] == "completed" and log.text == "Tool add returned: 5"
    assert await sync_to_async(tool_runs)(t) == 1
    [part] = tool_parts(await transcript("tool-agent", name))
    assert part["state"] == "output-available" and part["input"] == {"tag": t, "a": 2, "b": 3}
    assert part["output"] == 5


async def test_parallel_server_tools(dialect_stack: Any) -> None:
    name = new_name(dialect_stack, "parallel")
    t = f"tag-{uuid.uuid4().hex[:8]}"
    prompt = tool_prompt("add", tag=t, a=1, b=1) + " " + tool_prompt("add", tag=t, a=2, b=2)
    _, log = await turn(dialect_stack, "tool-agent", name, prompt)
    assert log.text == "Tool add returned: 2; Tool add returned: 4"
    parts = tool_parts(await transcript("tool-agent", name))
    assert [p["output"] for p in parts] == [2, 4] and len({p["toolCallId"] for p in parts}) == 2


async def test_a_client_tool(dialect_stack: Any) -> None:
    name = new_name(dialect_stack, "client")
    t = f"tag-{uuid.uuid4().hex[:8]}"
    async with ChatClient(dialect_stack.port, name, "tool-agent") as client:
        request_id = uuid.uuid4().hex[:8]
        prompt = tool_prompt("get_location", tag=t)
        await client.send(chat_request(request_id, [user_message(prompt)], clientTools=CLIENT_TOOLS))
        first = await client.follow(request_id, timeout=30)
        available = next(c for _, c in first.chunks if c["type"] == "tool-input-available")
        assert available["input"] == {"tag": t}
        await client.send(
            {
                "type": "cf_agent_tool_result",
                "toolCallId": available["toolCallId"],
                "toolName": "get_location",
                "output": {"city": "Lisbon"},
                "autoContinue": True,
            }
        )
        log = await follow_conversation(
            client, until=lambda log: any(s.done and s.done.get("continuation") for s in log.streams.values())
        )
    assert log.text == 'Tool get_location returned: {"city": "Lisbon"}'
    [part] = tool_parts(await transcript("tool-agent", name))
    assert part["state"] == "output-available" and part["output"] == {"city": "Lisbon"}


async def test_an_approval(dialect_stack: Any) -> None:
    name = new_name(dialect_stack, "approval")
    t = f"tag-{uuid.uuid4().hex[:8]}"
    async with ChatClient(dialect_stack.port, name, "tool-agent") as client:
        request_id = uuid.uuid4().hex[:8]
        await client.send(chat_request(request_id, [user_message(tool_prompt("delete_file", tag=t))]))
        first = await client.follow(request_id, timeout=30)
        request = next(c for _, c in first.chunks if c["type"] == "tool-approval-request")
        assert await sync_to_async(tool_runs)(t) == 0
        await client.send(
            {"type": "cf_agent_tool_approval", "toolCallId": request["toolCallId"], "approved": True}
        )
        log = await follow_conversation(
            client, until=lambda log: any(s.done and s.done.get("continuation") for s in log.streams.values())
        )
    assert log.text == f"Tool delete_file returned: deleted {t}"
    assert await sync_to_async(tool_runs)(t) == 1
    [part] = tool_parts(await transcript("tool-agent", name))
    assert part["state"] == "output-available"


async def test_sigkill_mid_stream_is_recovered(dialect_stack: Any) -> None:
    [worker] = dialect_stack.workers
    name = new_name(dialect_stack, "kill")
    async with ChatClient(dialect_stack.port, name) as client:
        request_id = uuid.uuid4().hex[:10]
        await client.send(chat_request(request_id, [user_message(f"count to 40 [rate 25] {name}")]))
        log = await follow_conversation(
            client, until=lambda log: len(log.stream(request_id).chunks) >= 12, timeout=30
        )
        worker.kill(signal.SIGKILL)
        dialect_stack.workers.remove(worker)
        await asyncio.to_thread(dialect_stack.start_worker)
        await follow_conversation(client, log, timeout=60)
    assert len(log.order) >= 2 and log.streams[request_id].done["outcome"] == "recovering"  # type: ignore[index]
    assert_clean(log, numbers(40))
    stored = await transcript("assistant", name)
    assert [m["role"] for m in stored] == ["user", "assistant"] and assistant_text(stored) == numbers(40)


@pytest.mark.parametrize(
    "fault",
    [
        "[fail after 0 with 429 once]",
        "[fail after 4 with 429 once]",
        "overload before",
        "overload mid-stream",
    ],
)
async def test_rate_limits_and_overload_are_handed_to_recovery(dialect_stack: Any, fault: str) -> None:
    status = 529 if dialect_stack.dialect == "anthropic" else 503  # each provider's "overloaded"
    fault = {
        "overload before": f"[fail after 0 with {status} once]",
        "overload mid-stream": f"[fail after 4 with {status} once]",
    }.get(fault, fault)
    name = new_name(dialect_stack, "fault")
    request_id, log = await turn(dialect_stack, "assistant", name, f"count to 20 {fault} {name}")
    assert len(log.order) == 2, "the failed turn, then the recovery that finished it"
    assert log.streams[request_id].done["outcome"] == "recovering"  # type: ignore[index]
    assert_clean(log, numbers(20))
    assert assistant_text(await transcript("assistant", name)) == numbers(20)
    interrupted = await Fiber.objects.aget(request_id=request_id)
    assert interrupted.interruption in {"transient", "rate_limit"}


async def test_a_reactive_overflow_is_compacted_and_retried(dialect_stack: Any, scripted_model: Any) -> None:
    name = new_name(dialect_stack, "reactive")
    await sync_to_async(seed)("reactive-agent", name)
    prompt = f"count to 5 [window 200] {name}"
    _, log = await turn(dialect_stack, "reactive-agent", name, prompt)
    assert last_done(log)["outcome"] == "completed" and log.text == numbers(5)
    compaction = await Compaction.objects.aget(conversation__name=name)
    assert (compaction.from_message_id, compaction.to_message_id) == ("h1", "h5")
    calls = [c for c in scripted_model.chats if c[-1].get("content") == prompt]
    assert len(calls) == 2, "refused with the provider's overflow error, then retried compacted"
    assert [m["content"] for m in calls[1]] == [f"0: {FILLER}", "Summary of 5 lines.", prompt]


async def test_a_proactive_overflow_reads_the_dialects_usage(dialect_stack: Any, scripted_model: Any) -> None:
    name = new_name(dialect_stack, "proactive")
    t = f"tag-{uuid.uuid4().hex[:8]}"
    await sync_to_async(seed)("proactive-agent", name)
    prompt = tool_prompt("add", tag=t, a=1, b=2)
    _, log = await turn(dialect_stack, "proactive-agent", name, prompt)
    assert last_done(log)["outcome"] == "completed" and log.text == "Tool add returned: 3"
    step1, step2 = [c for c in scripted_model.chats if any(m.get("content") == prompt for m in c)]
    assert len(step1) == 7, "the whole history: the previous step's usage comes from the dialect's fields"
    assert [m.get("content") for m in step2[:3]] == [f"0: {FILLER}", "Summary of 5 lines.", prompt]
    assert await Compaction.objects.filter(conversation__name=name).aexists()


async def test_a_stream_without_its_finish_reason_settles_every_tool_part(dialect_stack: Any) -> None:
    await assert_no_finish_settles(dialect_stack)


async def test_openai_without_a_finish_reason_settles_every_tool_part(stack: Any) -> None:
    stack.dialect = "openai"
    await assert_no_finish_settles(stack)


async def test_a_tool_call_cut_mid_arguments_is_repaired(dialect_stack: Any) -> None:
    await assert_cut_call_repaired(dialect_stack)


async def test_openai_tool_call_cut_mid_arguments_is_repaired(stack: Any) -> None:
    stack.dialect = "openai"
    await assert_cut_call_repaired(stack)


async def test_files_reach_the_model_in_the_dialects_own_form(
    dialect_stack: Any, scripted_model: Any
) -> None:
    await assert_files_reach_the_model(dialect_stack, scripted_model)


async def test_files_reach_the_openai_model(stack: Any, scripted_model: Any) -> None:
    stack.dialect = "openai"
    await assert_files_reach_the_model(stack, scripted_model)


async def assert_files_reach_the_model(stack: Any, scripted_model: Any) -> None:
    """An image, a PDF and a text file attached as data URLs: stored by the web process, read by the
    worker, and given to the model by litellm in the provider's own blocks (Anthropic's image and
    document, Gemini's inline data, OpenAI's image_url and file), the bytes intact."""
    name = new_name(stack, "files")
    notes = b"# Notes\nbuy milk\n"
    files = [
        ("image/png", PNG, "red.png"),
        ("application/pdf", PDF, "doc.pdf"),
        ("text/markdown", notes, "notes.md"),
    ]
    message = user_message(f"[files] {name}")
    message["parts"] += [file_part(*f) for f in files]
    async with ChatClient(stack.port, name) as client:
        await client.send(chat_request(uuid.uuid4().hex[:10], [message]))
        log = await follow_conversation(client, timeout=60)
    assert log.text.startswith("Files: ") and last_done(log)["outcome"] == "completed", log.text
    for media_type, data, _ in files[:2]:
        assert described(media_type, data) in log.text
    [chat] = [c for c in scripted_model.chats if name in message_text(c[-1])]
    assert "[File notes.md (text/markdown)]\n# Notes\nbuy milk" in message_text(chat[-1]), "text as text"
    [stored, _] = await transcript("assistant", name)
    urls = [p["url"] for p in stored["parts"] if p["type"] == "file"]
    assert len(urls) == 3 and all(file_id_of(u) for u in urls), "kept as files, not inline"


SETTLED = {"output-available", "output-error", "output-denied"}


async def settled_tool_turn(stack: Any, directive: str) -> tuple[str, ConversationLog, list[dict[str, Any]]]:
    """A server tool turn with `directive`; it completes and stores only settled tool parts."""
    name = new_name(stack, "settle")
    t = f"tag-{uuid.uuid4().hex[:8]}"
    _, log = await turn(stack, "tool-agent", name, f"{directive} {tool_prompt('add', tag=t, a=3, b=4)}")
    assert last_done(log)["outcome"] == "completed"
    parts = tool_parts(await transcript("tool-agent", name))
    assert parts and {p["state"] for p in parts} <= SETTLED, parts
    return t, log, parts


async def assert_no_finish_settles(stack: Any) -> None:
    """A complete tool call whose stream ends without a finish reason. Read lean (OpenAI: the stream still
    ends with [DONE]) or by litellm's Gemini reader, the call is settled as input-available and runs;
    litellm's Anthropic reader refuses such a stream, so the turn is interrupted, the call repaired as
    interrupted, and recovery continues the turn."""
    t, log, parts = await settled_tool_turn(stack, "[no finish once]")
    if stack.dialect == "anthropic":
        assert [p["state"] for p in parts] == ["output-error"] and await sync_to_async(tool_runs)(t) == 0
        assert log.text == f"Tool add returned: Error: {parts[0]['errorText']}"
    else:
        assert [p["state"] for p in parts] == ["output-available"] and await sync_to_async(tool_runs)(t) == 1
        assert log.text == "Tool add returned: 7"


async def assert_cut_call_repaired(stack: Any) -> None:
    """The connection is reset after a call's first argument piece: the stored partial's call is
    repaired (Gemini sends a call whole, so there is none yet) and the turn continues."""
    t, log, parts = await settled_tool_turn(stack, "[reset after 2 once]")
    if stack.dialect == "gemini":
        assert [p["state"] for p in parts] == ["output-available"] and log.text.endswith(
            "Tool add returned: 7"
        )
    else:
        assert parts[0]["state"] == "output-error" and await sync_to_async(tool_runs)(t) == 0
