"""MCP tools on the real stack: a worker's turn calls the test's MCP server (tests/mcp_server.py) over
streamable HTTP and over stdio; a call a SIGKILL cuts off is repaired like any server tool's, and runs
once; an approval from code runs an MCP tool; no client answers an MCP tool's call."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chat.transcript.repair import INTERRUPTED_TOOL_ERROR
from tests.agents import mcp_servers_set
from tests.mcp_server import calls, served
from tests.support import (
    ChatClient,
    ConversationLog,
    assistant_text,
    chat_request,
    continuation_completed,
    follow_conversation,
    transcript_of,
    user_message,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

AGENT = "mcp-agent"


@pytest.fixture(scope="module")
def call_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test's MCP server, over HTTP, and where McpAgent's turns find it; the log of its calls (the
    stdio server a turn starts writes to the same log)."""
    log = tmp_path_factory.mktemp("mcp") / "calls.jsonl"
    with served(log) as (_, url):
        mcp_servers_set(url, str(log))
        yield log


def name_for(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:8]}"


def prompt(*calls_: tuple[str, dict[str, Any]]) -> str:
    return " ".join(f"[tool {tool} {json.dumps(arguments)}]" for tool, arguments in calls_)


async def transcript(name: str) -> list[dict[str, Any]]:
    return await transcript_of(AGENT, name)


def mcp_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for m in messages for p in m["parts"] if p.get("type") == "dynamic-tool"]


def ran(call_log: Path, tool: str, **arguments: Any) -> int:
    return sum(c == {"tool": tool, "arguments": arguments} for c in calls(call_log))


async def test_a_turn_calls_an_http_and_a_stdio_servers_tools(stack: Any, call_log: Path) -> None:
    order = f"A-{uuid.uuid4().hex[:6]}"
    name = name_for("mcp")
    async with ChatClient(stack.port, name, AGENT) as client:
        await client.send(
            chat_request(
                "turn-1",
                [
                    user_message(
                        prompt(("shop_order_status", {"order_id": order}), ("add", {"a": 40, "b": 2}))
                    )
                ],
            )
        )
        log = await client.follow("turn-1", timeout=60)
    assert log.errors == [] and log.done is not None and log.done["outcome"] == "completed"
    starts = [c for _, c in log.chunks if c["type"] == "tool-input-start"]
    assert [(c["toolName"], c.get("dynamic")) for c in starts] == [("shop_order_status", True), ("add", True)]
    assert log.text == (
        f'Tool shop_order_status returned: {{"order": "{order}", "status": "shipped"}}; '
        'Tool add returned: {"result": 42}'
    )
    parts = mcp_parts(await transcript(name))
    assert [(p["toolName"], p["state"], p["output"]) for p in parts] == [
        ("shop_order_status", "output-available", {"order": order, "status": "shipped"}),
        ("add", "output-available", {"result": 42}),
    ]
    assert ran(call_log, "order_status", order_id=order, detail="short") == 1
    assert ran(call_log, "add", a=40, b=2) >= 1


async def test_an_mcp_call_cut_off_by_a_sigkill_is_repaired_and_never_run_again(
    recovery_stack: Any, call_log: Path
) -> None:
    seconds = 30 + uuid.uuid4().int % 1000 / 1000  # this test's own call, in a log all tests write to
    worker = recovery_stack.start_worker()
    name = name_for("mcp-kill")
    try:
        async with ChatClient(recovery_stack.port, name, AGENT) as client:
            await client.send(
                chat_request("turn-1", [user_message(prompt(("shop_slow", {"seconds": seconds})))])
            )

            def called(log: ConversationLog) -> bool:
                return any(
                    c["type"] == "tool-input-available" for s in log.streams.values() for _, c in s.chunks
                )

            log = await follow_conversation(client, until=called, timeout=30)
            await asyncio.to_thread(
                wait_until, lambda: ran(call_log, "slow", seconds=seconds), 30, "the call"
            )
            worker.kill(signal.SIGKILL)  # the MCP server is still sleeping on the call
            await asyncio.to_thread(recovery_stack.start_worker)

            await follow_conversation(client, log, until=continuation_completed, timeout=60)
    finally:
        recovery_stack.stop_workers()
    messages = await transcript(name)
    [part] = mcp_parts(messages)
    assert (part["toolName"], part["state"], part["errorText"]) == (
        "shop_slow",
        "output-error",
        INTERRUPTED_TOOL_ERROR,
    )
    assert assistant_text(messages) == f"Tool shop_slow returned: Error: {INTERRUPTED_TOOL_ERROR}"
    assert ran(call_log, "slow", seconds=seconds) == 1, "a call cut off is repaired, not made again"


async def test_an_approval_from_code_runs_an_mcp_tool_and_no_client_can_answer_it(
    stack: Any, call_log: Path
) -> None:
    from chat.agents import aopen_agent
    from chat.handle import aturn_wait

    reason = f"closed-{uuid.uuid4().hex[:6]}"
    name = name_for("mcp-approve")
    async with ChatClient(stack.port, name, AGENT) as client:
        await client.send(chat_request("turn-1", [user_message(prompt(("refuse", {"reason": reason})))]))
        log = await client.follow("turn-1", timeout=60)
        request = next(c for _, c in log.chunks if c["type"] == "tool-approval-request")
        call = request["toolCallId"]
        await client.send(
            json.dumps(
                {
                    "type": "cf_agent_tool_result",
                    "toolCallId": call,
                    "toolName": "refuse",
                    "output": "done, trust me",
                }
            )
        )
        refused = await client.recv_type("cf_agent_tool_refused", timeout=15)
        assert refused["toolCallId"] == call
    assert ran(call_log, "refuse", reason=reason) == 0, "nothing runs before the approval"

    handle = await aopen_agent(AGENT, name)
    decision = await handle.aapprove(call)
    assert decision.status == "applied" and decision.continuation_request_id
    result = await aturn_wait(
        conversation_id=handle.conversation_id, request_id=decision.continuation_request_id, timeout=60
    )
    assert result.status == "completed"
    messages = await transcript(name)
    [part] = mcp_parts(messages)
    assert part["state"] == "output-error" and part["errorText"].endswith(f": {reason}")
    assert assistant_text(messages) == f"Tool refuse returned: Error: {part['errorText']}"
    assert ran(call_log, "refuse", reason=reason) == 1
