"""The agent API a site's agents are written against: `Think` and what its options and hooks take.

The names live where they run (the agent class in chat.turn.agent, the registry in chat.turn.registry);
this module gathers them so that `from chat.agents import Think, tool` keeps working. chat.api is the
whole public face: this and the handle.
"""

from __future__ import annotations

from recovery.budget.incidents import ChatRecovery
from recovery.engine.context import ChatRecoveryContext, ChatRecoveryOptions
from recovery.process.runtime import db

from .exceptions import AccessDenied, ToolError, UnknownAgent
from .handle import AgentHandle
from .transcript.compaction import CompactionResult
from .transcript.services import conversation_claim, conversation_get_or_create
from .turn.agent import Think, current_agent
from .turn.context import RunContext
from .turn.errors import default_chat_error_classifier
from .turn.loop import StepResult
from .turn.mcp import MCPServer
from .turn.overflow import ChatErrorContext, ContextOverflow, Proactive, default_context_overflow_classifier
from .turn.pricing import ModelPrices
from .turn.registry import agent_class, agent_for, conversation_name_problem
from .turn.registry import kebab as kebab  # not public: kept for the imports it always answered
from .turn.session import create_compact_function
from .turn.tools import Tool, tool

__all__ = [
    "ChatErrorContext",
    "ChatRecovery",
    "ChatRecoveryContext",
    "ChatRecoveryOptions",
    "CompactionResult",
    "ContextOverflow",
    "MCPServer",
    "ModelPrices",
    "Proactive",
    "RunContext",
    "StepResult",
    "Think",
    "Tool",
    "ToolError",
    "UnknownAgent",
    "aopen_agent",
    "create_compact_function",
    "current_agent",
    "default_chat_error_classifier",
    "default_context_overflow_classifier",
    "open_agent",
    "tool",
]


def open_agent(agent: str, name: str, *, owner: str | None = None) -> AgentHandle:
    """The conversation (agent, name), created if new: the start of programmatic use.

    `open_agent("assistant", "support-42", owner=user_principal(request.user)).save_messages(["Hello"])`

    `owner` is the principal (chat.access) whose clients may open the conversation: a new or unowned
    conversation becomes theirs; one that belongs to someone else raises AccessDenied. Without it the
    conversation keeps its owner, and one created here has none (server code only).
    """

    agent_class(agent)  # UnknownAgent before anything is written
    problem = conversation_name_problem(name)
    if problem is not None:
        raise ValueError(f"{problem}: {name!r}")
    conversation = conversation_get_or_create(agent=agent, name=name, owner=owner or "")
    if (
        owner
        and conversation.owner != owner
        and not conversation_claim(conversation_id=conversation.pk, owner=owner)
    ):
        raise AccessDenied(f"conversation {agent}/{name} belongs to someone else")
    return AgentHandle(agent_for(agent, name, conversation.pk))


async def aopen_agent(agent: str, name: str, *, owner: str | None = None) -> AgentHandle:
    """open_agent() for async callers (an async view, a ninja endpoint): no sync_to_async needed. The
    handle's sync methods raise Django's SynchronousOnlyOperation there; use their `a`-prefixed twins."""
    return await db(open_agent, agent, name, owner=owner)
