"""The chat app's public face: everything a host site imports, in one place.

    from chat.api import Think, open_agent, tool

Each name is imported from its module when it is first used, so this module is safe to import from
settings, before Django's apps are ready, and costs nothing for the names a process never touches. A
name not listed here is internal and may move without notice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recovery.process.faces import lazy_face

# name -> the module that defines it
_FACE = {
    # agents: the class, its tools and the state of its running turn
    "Think": "chat.turn.agent",
    "current_agent": "chat.turn.agent",
    "RunContext": "chat.turn.context",
    "StepResult": "chat.turn.loop",
    "Tool": "chat.turn.tools",
    "tool": "chat.turn.tools",
    "ToolError": "chat.exceptions",
    "MCPServer": "chat.turn.mcp",
    "ModelPrices": "chat.turn.pricing",
    # errors, context overflow and compaction
    "ChatErrorContext": "chat.turn.overflow",
    "ContextOverflow": "chat.turn.overflow",
    "Proactive": "chat.turn.overflow",
    "default_context_overflow_classifier": "chat.turn.overflow",
    "default_chat_error_classifier": "chat.turn.errors",
    "Session": "chat.turn.session",
    "CompactionContext": "chat.turn.session",
    "create_compact_function": "chat.turn.session",
    "CompactionResult": "chat.transcript.compaction",
    # recovery: the budget and what its hooks are given
    "ChatRecovery": "recovery.budget.incidents",
    "ExhaustedContext": "recovery.budget.incidents",
    "ProgressContext": "recovery.budget.incidents",
    "ChatRecoveryContext": "recovery.engine.context",
    "ChatRecoveryOptions": "recovery.engine.context",
    # a conversation from code
    "open_agent": "chat.agents",
    "aopen_agent": "chat.agents",
    "AgentHandle": "chat.handle",
    "ChatResult": "chat.handle",
    "TurnResult": "chat.transcript.turns",
    "SubmitResult": "chat.transcript.submissions",
    "StopReport": "chat.transcript.stop",
    "TurnCompleted": "chat.turn.deliveries",
    "turn_completed": "chat.signals",
    # who may open a conversation
    "AccessPolicy": "chat.access",
    "SessionAccess": "chat.access",
    "UserAccess": "chat.access",
    "user_principal": "chat.access",
    "issue_token": "chat.tokens",
    # errors a host catches
    "AccessDenied": "chat.exceptions",
    "ConversationBusy": "chat.exceptions",
    "ConversationLimit": "chat.exceptions",
    "ToolCallNotWaiting": "chat.exceptions",
    "UnknownAgent": "chat.exceptions",
    # the site's asgi.py
    "websocket_urlpatterns": "chat.routing",
    "AuthMiddlewareStack": "chat.wire.auth",
    "AllowedHostsBrowserOriginValidator": "chat.wire.security",
    "BodyLimit": "chat.wire.bodies",
    # a site's own view answering with a turn's stream (the AI SDK's wire)
    "turn_response": "chat.wire.http",
}

__all__ = sorted(_FACE)


__getattr__, __dir__ = lazy_face(__name__, _FACE)

if TYPE_CHECKING:  # what a type checker knows of the names above (tests/test_faces.py)
    from recovery.budget.incidents import ChatRecovery as ChatRecovery
    from recovery.budget.incidents import ExhaustedContext as ExhaustedContext
    from recovery.budget.incidents import ProgressContext as ProgressContext
    from recovery.engine.context import ChatRecoveryContext as ChatRecoveryContext
    from recovery.engine.context import ChatRecoveryOptions as ChatRecoveryOptions

    from .access import AccessPolicy as AccessPolicy
    from .access import SessionAccess as SessionAccess
    from .access import UserAccess as UserAccess
    from .access import user_principal as user_principal
    from .agents import aopen_agent as aopen_agent
    from .agents import open_agent as open_agent
    from .exceptions import AccessDenied as AccessDenied
    from .exceptions import ConversationBusy as ConversationBusy
    from .exceptions import ConversationLimit as ConversationLimit
    from .exceptions import ToolCallNotWaiting as ToolCallNotWaiting
    from .exceptions import ToolError as ToolError
    from .exceptions import UnknownAgent as UnknownAgent
    from .handle import AgentHandle as AgentHandle
    from .handle import ChatResult as ChatResult
    from .routing import websocket_urlpatterns as websocket_urlpatterns
    from .signals import turn_completed as turn_completed
    from .tokens import issue_token as issue_token
    from .transcript.compaction import CompactionResult as CompactionResult
    from .transcript.stop import StopReport as StopReport
    from .transcript.submissions import SubmitResult as SubmitResult
    from .transcript.turns import TurnResult as TurnResult
    from .turn.agent import Think as Think
    from .turn.agent import current_agent as current_agent
    from .turn.context import RunContext as RunContext
    from .turn.deliveries import TurnCompleted as TurnCompleted
    from .turn.errors import default_chat_error_classifier as default_chat_error_classifier
    from .turn.loop import StepResult as StepResult
    from .turn.mcp import MCPServer as MCPServer
    from .turn.overflow import ChatErrorContext as ChatErrorContext
    from .turn.overflow import ContextOverflow as ContextOverflow
    from .turn.overflow import Proactive as Proactive
    from .turn.overflow import default_context_overflow_classifier as default_context_overflow_classifier
    from .turn.pricing import ModelPrices as ModelPrices
    from .turn.session import CompactionContext as CompactionContext
    from .turn.session import Session as Session
    from .turn.session import create_compact_function as create_compact_function
    from .turn.tools import Tool as Tool
    from .turn.tools import tool as tool
    from .wire.auth import AuthMiddlewareStack as AuthMiddlewareStack
    from .wire.bodies import BodyLimit as BodyLimit
    from .wire.http import turn_response as turn_response
    from .wire.security import AllowedHostsBrowserOriginValidator as AllowedHostsBrowserOriginValidator
