"""Agents used by the end-to-end tests. Their hooks record what they saw in Redis, so tests can read it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import redis
from django.conf import settings

from chat.agents import (
    ChatErrorContext,
    ChatRecovery,
    ChatRecoveryContext,
    ChatRecoveryOptions,
    ContextOverflow,
    MCPServer,
    ModelPrices,
    Proactive,
    RunContext,
    StepResult,
    Think,
    Tool,
    ToolError,
    create_compact_function,
    current_agent,
    tool,
)
from thinkproject.agents import Assistant


def probe_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.CACHES["default"]["LOCATION"])


def probe_key(kind: str, name: str) -> str:
    return f"thinktest:{settings.RUN_ID}:{kind}:{name}"  # type: ignore[misc]


def record_exhausted(ctx: Any) -> None:
    """Keyed by the root request id, which is the id of the turn the test client sent."""
    record = {"reason": ctx.reason, "incident_id": ctx.incident_id, "request_id": ctx.request_id}
    probe_redis().rpush(probe_key("exhausted", ctx.recovery_root_request_id), json.dumps(record))


class RecoveryProbe(Think):
    """Records every on_chat_recovery context; the conversation name picks the hook's answer."""

    chat_recovery = ChatRecovery(max_attempts=5, no_progress_timeout_ms=60_000, on_exhausted=record_exhausted)

    async def on_chat_recovery(self, ctx: ChatRecoveryContext) -> ChatRecoveryOptions:
        seen = {
            "kind": ctx.recovery_kind,
            "attempt": ctx.attempt,
            "stream_id": ctx.stream_id,
            "partial_text": ctx.partial_text,
            "created_at": ctx.created_at,
            "request_id": ctx.request_id,
            "root": ctx.recovery_root_request_id,
            "incident_id": ctx.incident_id,
        }
        probe_redis().rpush(probe_key("recovery", self.name), json.dumps(seen))
        # A turn created more than an hour ago is stale: keep its partial, run nothing.
        stale = "stale" in self.name and time.time() * 1000 - ctx.created_at > 3_600_000
        return ChatRecoveryOptions(
            persist="nopersist" not in self.name, continue_="nocontinue" not in self.name and not stale
        )


class CompletionProbe(Assistant):
    """Records every turn_completed result it gets (on_turn_completed), with the process that ran it."""

    def on_turn_completed(self, result: Any) -> None:
        seen = {
            "request_id": result.request_id,
            "last_request_id": result.last_request_id,
            "ending": result.ending,
            "text": result.text,
            "message_id": (result.message or {}).get("id"),
            "error": result.error,
            "pid": os.getpid(),
        }
        probe_redis().rpush(probe_key("completed", self.name), json.dumps(seen))


def completions_seen(name: str) -> list[dict[str, Any]]:
    return [json.loads(v) for v in probe_redis().lrange(probe_key("completed", name), 0, -1)]


class PricedAgent(Assistant):
    """The scripted model at prices of its own (per token), so a test can check each step's cost."""

    model_prices = ModelPrices(
        input=Decimal("0.000003"), output=Decimal("0.000015"), cached_input=Decimal("0.0000003")
    )


class BudgetAgent(Assistant):
    """A recovery budget of 50 tokens; what exhausted it is recorded (record_exhausted)."""

    chat_recovery = ChatRecovery(
        max_attempts=10, max_recovery_tokens=50, no_progress_timeout_ms=60_000, on_exhausted=record_exhausted
    )


class StallingAgent(Think):
    """A short stall watchdog and a small budget: a model that always stalls ends in the terminal message."""

    chat_stream_stall_timeout_ms = 1500
    chat_recovery = ChatRecovery(
        max_attempts=3,
        no_progress_timeout_ms=4000,
        terminal_message="Sorry: the model kept stalling.",
        on_exhausted=record_exhausted,
    )


class FlakyModelAgent(Think):
    """A small budget: a model that keeps failing (5xx, rate limits, broken streams) ends in the
    terminal message within seconds."""

    chat_recovery = ChatRecovery(
        max_attempts=3,
        no_progress_timeout_ms=4000,
        terminal_message="Sorry: the model kept failing.",
        on_exhausted=record_exhausted,
    )


class NoModelRecoveryAgent(Think):
    """chat_recovery = False: a transient model error ends the turn at once, as it did before."""

    chat_recovery = False


def tool_runs(tag: str) -> int:
    """How many times the test tools ran for this tag (tests pass the tag in the tool input)."""
    return int(probe_redis().get(probe_key("tool-runs", tag)) or 0)


def _ran(tag: str) -> None:
    probe_redis().incr(probe_key("tool-runs", tag))


TAGGED = {"type": "object", "properties": {"tag": {"type": "string"}}, "required": ["tag"]}


@tool(
    parameters={
        **TAGGED,
        "properties": {**TAGGED["properties"], "a": {"type": "integer"}, "b": {"type": "integer"}},
    }
)
def add(tag: str, a: int, b: int) -> int:
    """Add two integers."""
    _ran(tag)
    return a + b


@tool(parameters=TAGGED)
async def lookup(tag: str) -> dict[str, Any]:
    """An async tool."""
    _ran(tag)
    return {"tag": tag, "found": True}


@tool(parameters=TAGGED)
def explode(tag: str) -> None:
    """A tool that always fails."""
    _ran(tag)
    raise RuntimeError("the tool exploded")


# What an unexpected tool exception may carry; clients and the model must never read it.
LEAKED_SECRET = "postgres://admin:pw@10.0.0.5/db"


@tool(parameters=TAGGED)
def leak(tag: str) -> None:
    """A tool whose exception names an internal database, as a failed connection would."""
    _ran(tag)
    raise ConnectionError(f"could not connect to {LEAKED_SECRET}")


@tool(parameters=TAGGED)
def refuse(tag: str) -> None:
    """A tool that tells the model why it did not run, on purpose."""
    _ran(tag)
    raise ToolError("not allowed")


@tool(parameters={**TAGGED, "properties": {**TAGGED["properties"], "size": {"type": "integer"}}})
def bulky(tag: str, size: int) -> str:
    """An output of `size` characters in one word (a frame too large to send whole)."""
    _ran(tag)
    return "x" * size


@tool(parameters=TAGGED, needs_approval=True)
def delete_file(tag: str) -> str:
    """A dangerous tool: a human approves each call."""
    _ran(tag)
    return f"deleted {tag}"


@tool
async def typed_add(ctx: RunContext, tag: str, a: int, b: int = 0) -> dict[str, Any]:
    """Add two integers (a typed tool: its schema comes from these hints).

    Args:
        tag: The test's tag.
        a: The first integer.
        b: The second integer.
    """
    _ran(tag)
    return {"sum": a + b, "call": ctx.tool_call_id}


@tool
def whoami(ctx: RunContext, tag: str) -> dict[str, Any]:
    """What the tool's RunContext says of the running turn."""
    _ran(tag)
    user = ctx.user.get_username() if ctx.user is not None else None
    return {
        "owner": ctx.owner,
        "user": user,
        "conversation": ctx.conversation.name,
        "agent": ctx.agent.name,
        "request_id": ctx.request_id,
        "attempt": ctx.attempt,
        "call": ctx.tool_call_id,
        "same_as_agent": ctx is not None and ctx.agent.context is not None and ctx.agent is current_agent(),
    }


class ToolAgent(Think):
    """Server tools, one needing approval; a conversation named `hold-*` pauses after each tool step
    (a window to kill the worker in); `ask_user` calls interrupted mid-way become a text part."""

    chat_recovery = ChatRecovery(max_attempts=5, stable_timeout_ms=1500, no_progress_timeout_ms=60_000)
    tools = [add, lookup, explode, delete_file, bulky, leak, refuse, typed_add, whoami]

    async def on_step_finish(self, step: StepResult) -> None:
        if self.name.startswith("hold-") and step.tool_calls:
            await asyncio.sleep(30)

    def repair_interrupted_tool_part(self, part: dict[str, Any]) -> dict[str, Any]:
        if part.get("type") == "tool-ask_user":
            return {"type": "text", "text": "(The question to the user was interrupted.)", "state": "done"}
        return super().repair_interrupted_tool_part(part)


@tool(parameters={**TAGGED, "properties": {**TAGGED["properties"], "note": {"type": "string"}}})
def remember(tag: str, note: str) -> str:
    """Stash a note with the running turn (a sync tool reaching its agent)."""
    agent = current_agent()
    assert agent is not None
    agent.stash({"tag": tag, "note": note})
    return "noted"


class StashAgent(Think):
    tools = [remember]


def record_chat_error(agent: Think, error: Any, ctx: ChatErrorContext) -> str:
    record = {"classification": ctx.classification, "stage": ctx.stage, "request_id": ctx.request_id}
    probe_redis().rpush(probe_key("chat-error", agent.name), json.dumps(record))
    return f"Sorry, that conversation got too long ({ctx.classification})."


class ReactiveAgent(Think):
    """Reactive overflow recovery: compacts everything but the first message and the newest turn."""

    context_overflow = ContextOverflow(reactive=True)
    # A plain function as a class attribute: the session gets it as it is, not as a method.
    compaction = create_compact_function(protect_head=1, tail_tokens=60, min_tail_messages=1)

    def on_chat_error(self, error: Any, ctx: ChatErrorContext) -> Any:
        return record_chat_error(self, error, ctx)


class ProactiveAgent(ReactiveAgent):
    """Proactive only: compacts before a step whose previous step used 90% of 300 tokens."""

    context_overflow = ContextOverflow(proactive=Proactive(max_input_tokens=300))
    tools = [add]


class BothLayersAgent(ProactiveAgent):
    context_overflow = ContextOverflow(
        reactive=True, proactive=Proactive(max_input_tokens=300, max_compactions=2)
    )


class ReattachAgent(Assistant):
    """model_reattach: its turns use the Responses API in background mode, and a recovered turn rejoins
    the provider's generation instead of starting a new one."""

    model_reattach = True
    chat_recovery = ChatRecovery(max_attempts=5, no_progress_timeout_ms=60_000)

    def get_tools(self) -> list[Tool]:
        return [*super().get_tools(), add]  # add counts its runs (tool_runs)


class LitellmReadAgent(Assistant):
    """The demo agent with every model stream read by litellm (Think.lean_model_read off)."""

    lean_model_read = False


def mcp_servers_set(url: str, call_log: str) -> None:
    """Where McpAgent's turns find the test's MCP server (tests/mcp_server.py), for this run."""
    probe_redis().set(probe_key("mcp", "servers"), json.dumps({"url": url, "call_log": call_log}))


class McpAgent(Think):
    """Tools from two MCP servers, chosen per turn (`get_mcp_servers`): the test's server over streamable
    HTTP, its tools prefixed `shop_`, and the same server over stdio with only `add` and `refuse`, which
    a human approves."""

    chat_recovery = ChatRecovery(max_attempts=5, stable_timeout_ms=1500, no_progress_timeout_ms=60_000)

    def get_mcp_servers(self) -> list[MCPServer]:
        found = json.loads(probe_redis().get(probe_key("mcp", "servers")) or "{}")  # type: ignore[arg-type]
        return [
            MCPServer("shop", url=found["url"], tool_prefix="shop_", timeout_s=60),
            MCPServer(
                "local",
                command=sys.executable,
                args=["-m", "tests.mcp_server", "stdio"],
                env={"MCP_CALL_LOG": found["call_log"]},
                cwd=str(Path(__file__).resolve().parent.parent),
                tools=["add", "refuse"],
                needs_approval=["refuse"],
            ),
        ]
