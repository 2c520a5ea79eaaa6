"""The checks of one agent class, as `manage.py check` reports them (`Think.check()`): its options'
types and values, and hooks written in a way that would not be called as meant. chat.checks runs them
for every registered agent, beside the checks of the settings."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Sequence
from typing import Any

from django.core.checks import CheckMessage, Error

from recovery.budget.incidents import ChatRecovery

from .agent import MESSAGE_CONCURRENCY_POLICIES, Think, plain_attribute
from .mcp import MCPServer
from .overflow import ContextOverflow
from .prefill import STYLES
from .pricing import ModelPrices
from .tools import Tool


def think_class_errors(cls: type[Think], *, label: str) -> list[CheckMessage]:
    """What is wrong with an agent class's options and hooks (Think.check)."""
    found: list[tuple[str, str, str | None]] = [*_option_errors(cls), *_hook_errors(cls)]
    return [
        Error(f"Agent {label!r} ({cls.__qualname__}): {message}", hint=hint, obj=cls, id=error_id)
        for message, error_id, hint in found
    ]


def _option_errors(cls: type[Think]) -> list[tuple[str, str, str | None]]:
    found: list[tuple[str, str, str | None]] = []
    stall = cls.chat_stream_stall_timeout_ms
    if isinstance(stall, bool) or not isinstance(stall, int) or stall < 0:
        found.append(
            (f"chat_stream_stall_timeout_ms must be an int >= 0 (0 = off), got {stall!r}.", "E012", None)
        )
    steps = cls.max_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        found.append((f"max_steps must be an int >= 1, got {steps!r}.", "E013", None))
    if cls.message_concurrency not in MESSAGE_CONCURRENCY_POLICIES:
        policy = cls.message_concurrency
        found.append(
            (f"message_concurrency must be 'queue', 'latest' or 'drop', got {policy!r}.", "E014", None)
        )
    if not isinstance(cls.chat_recovery, ChatRecovery | bool | None):
        recovery = cls.chat_recovery
        found.append(
            (f"chat_recovery must be a ChatRecovery, True, False or None, got {recovery!r}.", "E015", None)
        )
    overflow = cls.context_overflow
    if not isinstance(overflow, ContextOverflow | None):
        found.append((f"context_overflow must be a ContextOverflow or None, got {overflow!r}.", "E016", None))
    elif overflow is not None and not _compacts(cls):
        hint = "Set `compaction = create_compact_function()` (or session.on_compaction in configure_session)."
        found.append(("context_overflow needs a compaction function, and the agent has none.", "E017", hint))
    compaction = plain_attribute(cls, "compaction")
    if compaction is not None and not callable(compaction):
        found.append((f"compaction must be a function or None, got {compaction!r}.", "E018", None))
    tools = cls.tools
    if not _tool_list(tools):
        found.append(
            (f"tools must be a list of Tool objects (made with @tool), got {tools!r}.", "E019", None)
        )
    else:
        hint = "Annotate its parameters with types pydantic can validate, or pass parameters={...}."
        found.extend((f"{t.schema_error}.", "E029", hint) for t in tools if t.schema_error is not None)
    servers = cls.mcp_servers
    if (
        isinstance(servers, str | bytes)
        or not isinstance(servers, Sequence)
        or not all(isinstance(item, MCPServer) for item in servers)
    ):
        found.append((f"mcp_servers must be a list of MCPServer objects, got {servers!r}.", "E031", None))
    elif servers and importlib.util.find_spec("mcp") is None:
        hint = "pip install 'thinkproject[mcp]' (the official MCP SDK)."
        found.append(("mcp_servers needs the mcp package, which is not installed.", "E031", hint))
    model = cls.model
    if not (
        model is None or (isinstance(model, str) and model) or (isinstance(model, dict) and "model" in model)
    ):
        found.append((f"model must be a model string or a dict with 'model', got {model!r}.", "E020", None))
    if not isinstance(cls.system_prompt, str | None):
        found.append((f"system_prompt must be a string or None, got {cls.system_prompt!r}.", "E021", None))
    if cls.continuation_style not in STYLES:
        style = cls.continuation_style
        found.append(
            (f"continuation_style must be 'auto', 'prefill' or 'instruction', got {style!r}.", "E033", None)
        )
    if not isinstance(cls.model_prices, ModelPrices | None):
        found.append(
            (
                f"model_prices must be a ModelPrices or None, got {cls.model_prices!r}.",
                "E032",
                "ModelPrices(input=Decimal('0.000003'), output=Decimal('0.000015')): prices per token.",
            )
        )
    return [(message, f"think_chat.{error_id}", hint) for message, error_id, hint in found]


def _hook_errors(cls: type[Think]) -> list[tuple[str, str, str | None]]:
    found: list[tuple[str, str, str | None]] = []
    if inspect.iscoroutinefunction(cls.should_keep_recovering):
        found.append(("should_keep_recovering must be synchronous (not async def).", "think_chat.E022", None))
    classifier = inspect.getattr_static(cls, "classify_chat_error")
    if inspect.isfunction(classifier) and next(iter(inspect.signature(classifier).parameters), "") != "self":
        found.append(
            (
                "classify_chat_error is a plain function in the class body: it would be called as a method.",
                "think_chat.E023",
                "Define `def classify_chat_error(self, error, ctx)`, or assign one of the callable "
                "classifiers (default_chat_error_classifier, default_context_overflow_classifier).",
            )
        )
    return found


def _tool_list(tools: Any) -> bool:
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        return False
    return all(isinstance(item, Tool) for item in tools)


def _compacts(cls: type[Think]) -> bool:
    """Whether the agent can compact: a compaction function, or its own session set-up or getter."""
    return (
        plain_attribute(cls, "compaction") is not None
        or cls.configure_session is not Think.configure_session
        or cls.get_compaction is not Think.get_compaction
    )
