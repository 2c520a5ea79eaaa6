"""The agent API: `Think`, the base class of every chat agent, and the state of its running turn.

`Think` is configured the way a ModelAdmin is: a plain class attribute for the simple case, with a
`get_*()` method behind it for the dynamic one, and every other extension point a method (a hook).
Mistakes in a registered agent's configuration are reported by `manage.py check` (`Think.check()`).
Agents are found by name in chat.turn.registry; code outside a turn reaches a conversation through the
handle `chat.api.open_agent()` returns.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from django.core.checks import CheckMessage

from recovery.budget.incidents import ChatRecovery, ExhaustedContext, ProgressContext, resolve_chat_recovery
from recovery.engine.context import ChatRecoveryContext, ChatRecoveryOptions
from recovery.lease.fibers import fiber_stash
from recovery.process.runtime import db, maybe_await

from ..conf import default_model
from ..transcript.repair import default_repair
from ..types import Chunk, Part
from . import llm
from .context import RunContext
from .errors import default_chat_error_classifier
from .loop import StepResult
from .mcp import MCPServer
from .overflow import ChatErrorContext, ContextOverflow
from .prefill import prefill_style
from .pricing import ModelPrices
from .session import CompactionFunction, Session
from .tools import Tool

if TYPE_CHECKING:
    from .deliveries import TurnCompleted

# What a request does while another turn is busy (see chat.transcript.turns.turn_accept).
MESSAGE_CONCURRENCY_POLICIES = ("queue", "latest", "drop")

ChunkCallback = Callable[[Chunk], Awaitable[None] | None]


@dataclass(frozen=True)
class TurnContext:
    fiber_id: Any
    fencing: int
    request_id: str


class Think:
    """A chat agent. Subclass it, set its options, override the hooks you need, and register it by name
    in THINK["AGENTS"].

    Options are class attributes, each read through a `get_*()` method an agent may override to decide
    per conversation. Hooks are methods; those that say so may be async. One instance is built per turn
    (and per recovery step) for one conversation, so instance state does not survive between turns:
    durable state belongs in the conversation's messages, or in `stash()` for the turn's recovery.
    """

    # -- options ---------------------------------------------------------------------------------------
    #: A litellm model string, or a dict of litellm completion kwargs (model, api_base, ...); None uses
    #: THINK["MODEL"] (`get_model()`).
    model: ClassVar[str | dict[str, Any] | None] = None
    #: Put in front of every model call (`get_system_prompt()`).
    system_prompt: ClassVar[str | None] = None
    #: The server tools the model may call; client tools come from the client's request (`get_tools()`).
    tools: ClassVar[Sequence[Tool]] = ()
    #: MCP servers whose tools the model may call too (`get_mcp_servers()`; the `mcp` extra). A turn
    #: connects to each when it starts (chat.turn.mcp).
    mcp_servers: ClassVar[Sequence[MCPServer]] = ()
    #: Recovery budget and give-up behaviour (`get_chat_recovery()`). Recovery from crashes cannot be
    #: switched off; False only makes a rate-limited or transiently failed model call end the turn at once.
    chat_recovery: ClassVar[ChatRecovery | bool | None] = True
    #: Recover from a context window overflow by compacting (`get_context_overflow()`); both layers
    #: need a compaction function.
    context_overflow: ClassVar[ContextOverflow | None] = None
    #: The session's compaction function, e.g. `create_compact_function()` (`get_compaction()`).
    compaction: ClassVar[CompactionFunction | None] = None
    #: Call the model through OpenAI's Responses API in background mode, so that a turn recovered after
    #: a crash rejoins the provider's own generation (after the last stored event) instead of paying
    #: for a new one; when the provider no longer has it, the turn continues as usual (README).
    model_reattach: ClassVar[bool] = False
    #: Read an OpenAI-compatible provider's stream (OpenAI, vLLM, OpenRouter, ... and the scripted model)
    #: with the project's lean reader; litellm still routes and builds the request and maps its errors.
    #: False streams every byte through litellm. Other providers always go through litellm.
    lean_model_read: ClassVar[bool] = True
    #: How a continuation asks the model to go on: "prefill" (the partial stays the last message, as an
    #: assistant message the model extends), "instruction" (a user message asks it to continue), or
    #: "auto": prefill where the provider supports it (chat.turn.prefill), else the instruction
    #: (`get_continuation_style()`).
    continuation_style: ClassVar[str] = "auto"
    #: Abort a stream silent for this long and recover it (0 = off).
    chat_stream_stall_timeout_ms: ClassVar[int] = 0
    #: Model steps per turn: each step after the first follows server tool results.
    max_steps: ClassVar[int] = 10
    #: A request while another turn is busy: "queue" (after it), "latest" (skip older queued ones), "drop".
    message_concurrency: ClassVar[str] = "queue"
    #: Prices per token of the model (a ModelPrices), for each step's cost; None: litellm's cost map.
    model_prices: ClassVar[ModelPrices | None] = None
    #: Let clients write any history: system, assistant and tool messages in a chat request are stored
    #: and sent to the model. Off, a client adds user messages only (text, files, data) and a request
    #: with anything else is refused. On, whoever holds the socket can put words in the model's mouth and
    #: place instructions above the system prompt: only for clients the site trusts as much as itself.
    accept_client_history: ClassVar[bool] = False

    def __init__(self, *, agent: str, name: str, conversation_id: int | None = None) -> None:
        self.agent = agent
        self.name = name
        self.conversation_id = conversation_id
        self.turn: TurnContext | None = None  # set while this instance runs a turn
        #: The running turn's RunContext (owner, user, request id, attempt); None outside a turn.
        self.context: RunContext | None = None
        self._session: Session | None = None

    # -- get_*(): the options, for an agent that decides them per conversation ---------------------------
    def get_model(self) -> str | dict[str, Any]:
        """The model: `model`, else THINK["MODEL"]; with neither the turn fails with ImproperlyConfigured
        (and `manage.py check` says so beforehand, think_chat.E011)."""
        return self.model if self.model is not None else default_model()

    def get_system_prompt(self) -> str | None:
        """The system prompt: `system_prompt`."""
        return self.system_prompt

    def get_tools(self) -> list[Tool]:
        """The server tools: `tools`."""
        return list(self.tools)

    def get_mcp_servers(self) -> list[MCPServer]:
        """The MCP servers whose tools the model may call: `mcp_servers`. Override it to choose them per
        conversation (`self.context` holds the turn's owner and user), or to read a URL or a token: an
        override runs on a thread of the worker's (the ORM works there), and may be `async def`."""
        return list(self.mcp_servers)

    def get_chat_recovery(self) -> ChatRecovery:
        """The recovery budget: `chat_recovery` (True or None: the defaults)."""
        return resolve_chat_recovery(self.chat_recovery)

    def get_context_overflow(self) -> ContextOverflow | None:
        """How a context window overflow is recovered: `context_overflow`."""
        return self.context_overflow

    def get_continuation_style(self) -> str:
        """ "prefill" or "instruction" for this agent's model: `continuation_style`, with "auto" decided
        by the model's provider (chat.turn.prefill)."""
        if self.continuation_style != "auto":
            return self.continuation_style
        return prefill_style(self.completion_kwargs())

    def get_compaction(self) -> CompactionFunction | None:
        """The compaction function: `compaction` (a plain function there is not made a method)."""
        return plain_attribute(type(self), "compaction")

    # -- hooks -------------------------------------------------------------------------------------------
    def configure_session(self, session: Session) -> None:
        """Set the session up; by default it compacts with `get_compaction()`."""
        compaction = self.get_compaction()
        if compaction is not None:
            session.on_compaction(compaction)

    def classify_chat_error(self, error: Any, ctx: ChatErrorContext) -> str | None:
        """Classify a model error: "context_overflow", "rate_limit", "transient", "fatal", "unknown" or
        None; "rate_limit" and "transient" send the turn to recovery."""
        return default_chat_error_classifier(error, ctx)

    def on_chat_error(self, error: Any, ctx: ChatErrorContext) -> Any:
        """What clients see of a turn's error: a string is sent as it is; an exception (the default) is
        shown as a generic text naming its class and `ctx.fault` (chat.turn.faults). May be async."""
        return error

    def on_step_finish(self, step: StepResult) -> Any:
        """Called after every model step (and its tools); may be async."""
        return None

    def repair_interrupted_tool_part(self, part: Part) -> Part:
        """The replacement of a tool part an interruption left without a result (must be settled)."""
        return default_repair(part)

    def recovers_model_errors(self) -> bool:
        """Whether a rate-limited or transiently failed model call goes to recovery (else the turn ends
        with its error at once): by default, unless `chat_recovery` is False."""
        return self.chat_recovery is not False

    async def on_chat_recovery(self, ctx: ChatRecoveryContext) -> ChatRecoveryOptions | None:
        """Decide what happens to an interrupted turn: keep the partial, continue or retry it."""
        return ChatRecoveryOptions()

    def should_keep_recovering(self, ctx: ProgressContext) -> bool:
        """Consulted before each recovery attempt from the second on; False gives up. Synchronous.

        By default the answer of `chat_recovery.should_keep_recovering`, else True."""
        predicate = self.get_chat_recovery().should_keep_recovering
        return True if predicate is None else predicate(ctx)

    async def on_recovery_exhausted(self, ctx: ExhaustedContext) -> None:
        """Recovery gave up (what it raises is logged); by default `chat_recovery.on_exhausted`."""
        handler = self.get_chat_recovery().on_exhausted
        if handler is not None:
            await maybe_await(handler(ctx))

    def get_model_prices(self) -> ModelPrices | None:
        """The prices of this agent's model (`model_prices`), for the cost of each step; None: litellm's
        cost map, which leaves a model it does not know unpriced."""
        return self.model_prices

    def on_turn_completed(self, result: TurnCompleted) -> Any:
        """A turn of this agent ended (`result.ending`: completed, recovered, exhausted, cancelled, failed,
        skipped), with its answer as stored: called once per turn after the commit that ended it, on the
        process that ended it (or the tick's sweep). May be async; a sync one runs in a database thread.
        What it raises is logged. `chat.signals.turn_completed` carries the same result to receivers."""
        return None

    # -- the running turn and its conversation -----------------------------------------------------------
    @property
    def session(self) -> Session:
        """The conversation's session, configured once per agent instance."""
        if self._session is None:
            self._session = Session(self, complete_text=llm.complete_text)
            self.configure_session(self._session)
        return self._session

    def stash(self, data: Any) -> None:
        """Keep JSON data with the running turn; recovery hands it back as `ctx.recovery_data`."""

        turn = self.turn
        if turn is None:
            raise RuntimeError("stash() is only available while a turn of this agent runs")
        fiber_stash(fiber_id=turn.fiber_id, fencing=turn.fencing, data=data)

    async def astash(self, data: Any) -> None:

        await db(self.stash, data)

    def completion_kwargs(self) -> dict[str, Any]:
        """The litellm kwargs of get_model() as a dict."""
        model = self.get_model()
        if isinstance(model, str):
            return {"model": model}
        if not isinstance(model, dict) or "model" not in model:
            raise TypeError(
                f"{type(self).__name__}.get_model() must return a model string or a dict with 'model'"
            )
        return dict(model)

    def _require_conversation(self) -> int:
        if self.conversation_id is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a conversation")
        return self.conversation_id

    # -- configuration checks ----------------------------------------------------------------------------
    @classmethod
    def check(cls, *, label: str = "") -> list[CheckMessage]:
        """The mistakes in this agent's options and hooks, as `manage.py check` reports them."""
        from .agent_checks import think_class_errors

        return think_class_errors(cls, label=label or cls.__name__)


def recovery_config(agent: Think) -> ChatRecovery:
    """The budget the recovery engine spends on one of the agent's turns, with the agent's hooks in it."""
    return dataclasses.replace(
        agent.get_chat_recovery(),
        should_keep_recovering=agent.should_keep_recovering,
        on_exhausted=agent.on_recovery_exhausted,
    )


def plain_attribute(cls: type, name: str) -> Any:
    """A class attribute as it was assigned: a function stays a function, not a method of the agent."""
    value = inspect.getattr_static(cls, name, None)
    return value.__func__ if isinstance(value, staticmethod) else value


def current_agent() -> Think | None:
    """The agent whose turn is running in this context (tools use it to reach `stash`, say)."""
    return current_agent_var.get()


current_agent_var: ContextVar[Think | None] = ContextVar("think_current_agent", default=None)
