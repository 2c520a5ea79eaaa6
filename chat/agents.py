"""The agent API: the Think base class and the registry of agents by name."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from django.utils.module_loading import import_string

from recovery.context import ChatRecoveryContext, ChatRecoveryOptions
from recovery.incidents import ChatRecovery

from .conf import default_model, think_setting
from .exceptions import UnknownAgent
from .transcript.compaction import CompactionResult, Session, create_compact_function
from .transcript.repair import default_repair, pending_interaction
from .turn.errors import default_chat_error_classifier
from .turn.loop import StepResult
from .turn.overflow import (
    ChatErrorContext,
    ContextOverflow,
    Proactive,
    default_context_overflow_classifier,
    resolve_context_overflow,
)
from .turn.tools import Tool, tool

if TYPE_CHECKING:
    from .handle import ChatResult, TurnResult
    from .models import Submission
    from .transcript.submissions import SubmitResult

# What a request does while another turn is busy (see chat.transcript.services.turn_accept).
MESSAGE_CONCURRENCY_POLICIES = ("queue", "latest", "drop")

ChunkCallback = Callable[[dict[str, Any]], Awaitable[None] | None]


@dataclass(frozen=True)
class TurnContext:
    fiber_id: Any
    fencing: int
    request_id: str


__all__ = [
    "ChatErrorContext",
    "CompactionResult",
    "ContextOverflow",
    "Proactive",
    "create_compact_function",
    "default_chat_error_classifier",
    "default_context_overflow_classifier",
    "ChatRecovery",
    "ChatRecoveryContext",
    "ChatRecoveryOptions",
    "StepResult",
    "Think",
    "Tool",
    "UnknownAgent",
    "agent_class",
    "agent_for",
    "current_agent",
    "kebab",
    "open_agent",
    "tool",
]


def kebab(name: str) -> str:
    """The client's camelCase-to-kebab rule: `ChatAgent` -> `chat-agent`, `MY_AGENT` -> `my-agent`."""
    if name.isupper():
        return name.lower().replace("_", "-")
    converted = re.sub(r"[A-Z]", lambda m: "-" + m.group(0).lower(), name)
    converted = converted[1:] if converted.startswith("-") else converted
    converted = converted.replace("_", "-")
    return converted[:-1] if converted.endswith("-") else converted


class Think:
    """A chat agent. Subclass it, override the hooks, and register it by name in THINK["AGENTS"].

    One instance is built per turn (and per recovery step) for one conversation, so instance state
    does not survive between turns: durable state belongs in the conversation's messages.
    """

    #: Recovery budget and give-up behaviour. Recovery from crashes cannot be switched off;
    #: False only makes a rate-limited or transiently failed model call end the turn at once.
    chat_recovery: ClassVar[ChatRecovery | bool | None] = True
    #: Call the model through OpenAI's Responses API in background mode, so that a turn recovered after
    #: a crash rejoins the provider's own generation (after the last stored event) instead of paying
    #: for a new one; when the provider no longer has it, the turn continues as usual (README).
    model_reattach: ClassVar[bool] = False
    #: Read an OpenAI-compatible provider's stream (OpenAI, vLLM, OpenRouter, ... and the scripted model)
    #: with the project's lean reader; litellm still routes and builds the request and maps its errors.
    #: False streams every byte through litellm. Other providers always go through litellm.
    lean_model_read: ClassVar[bool] = True
    #: Abort a stream silent for this long and recover it (0 = off).
    chat_stream_stall_timeout_ms: ClassVar[int] = 0
    #: Model steps per turn: each step after the first follows server tool results.
    max_steps: ClassVar[int] = 10
    #: A request while another turn is busy: "queue" (after it), "latest" (skip older queued ones), "drop".
    message_concurrency: ClassVar[str] = "queue"
    #: Recover from a context window overflow by compacting (both layers need configure_session).
    context_overflow: ClassVar[ContextOverflow | None] = None
    #: Classifies a model error ("context_overflow", "rate_limit", "transient", "fatal", "unknown" or None);
    #: "rate_limit" and "transient" send the turn to recovery.
    classify_chat_error: Any = default_chat_error_classifier

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        stall = cls.chat_stream_stall_timeout_ms
        if isinstance(stall, bool) or not isinstance(stall, int) or stall < 0:
            raise ValueError(
                f"{cls.__name__}.chat_stream_stall_timeout_ms must be an int >= 0 (0 = off), got {stall!r}"
            )
        steps = cls.max_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"{cls.__name__}.max_steps must be an int >= 1, got {steps!r}")
        resolve_context_overflow(cls.context_overflow, cls.__name__)
        if cls.message_concurrency not in MESSAGE_CONCURRENCY_POLICIES:
            raise ValueError(
                f"{cls.__name__}.message_concurrency must be 'queue', 'latest' or 'drop',"
                f" got {cls.message_concurrency!r}"
            )
        if not isinstance(cls.chat_recovery, ChatRecovery | bool | None):
            raise TypeError(f"{cls.__name__}.chat_recovery must be a ChatRecovery, got {cls.chat_recovery!r}")

    def __init__(self, *, agent: str, name: str, conversation_id: int | None = None) -> None:
        self.agent = agent
        self.name = name
        self.conversation_id = conversation_id
        self.turn: TurnContext | None = None  # set while this instance runs a turn
        self._session: Session | None = None

    def get_model(self) -> str | dict[str, Any]:
        """A litellm model string, or a dict of litellm completion kwargs (model, api_base, ...).

        By default THINK["MODEL"]; when that is not set either the turn fails with ImproperlyConfigured
        (and `manage.py check` says so beforehand, think_chat.E011).
        """
        return default_model()

    def get_system_prompt(self) -> str | None:
        """The system prompt put in front of every model call, or None."""
        return None

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

    def configure_session(self, session: Session) -> None:
        """Set the session up, e.g. `session.on_compaction(create_compact_function())`."""

    @property
    def session(self) -> Session:
        """The conversation's session, configured once per agent instance."""
        if self._session is None:
            self._session = Session(self)
            self.configure_session(self._session)
        return self._session

    def on_chat_error(self, error: Any, ctx: ChatErrorContext) -> Any:
        """What clients see of a turn's error (its text is sent); may be async."""
        return error

    def get_tools(self) -> list[Tool]:
        """The server tools the model may call (client tools come from the client's request)."""
        return []

    def on_step_finish(self, step: StepResult) -> Any:
        """Called after every model step (and its tools); may be async."""
        return None

    def repair_interrupted_tool_part(self, part: dict[str, Any]) -> dict[str, Any]:
        """The replacement of a tool part an interruption left without a result (must be settled)."""
        return default_repair(part)

    # -- recovery hooks ----------------------------------------------------------------------------
    async def on_chat_recovery(self, ctx: ChatRecoveryContext) -> ChatRecoveryOptions | None:
        """Decide what happens to an interrupted turn: keep the partial, continue or retry it."""
        return ChatRecoveryOptions()

    # -- the conversation, for user code and the recovery engine ------------------------------------
    def _require_conversation(self) -> int:
        if self.conversation_id is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a conversation")
        return self.conversation_id

    def messages(self) -> list[dict[str, Any]]:
        """The stored transcript, as UIMessages."""
        from .transcript.selectors import messages_list

        return messages_list(conversation_id=self._require_conversation())

    def has_pending_interaction(self, extra: list[dict[str, Any]] | None = None) -> bool:
        """True while a human must act: an approval is requested or a client tool awaits its result.

        `extra` adds messages not stored yet (the partial of an interrupted turn).
        """
        from .models import Conversation

        conversation_id = self._require_conversation()
        tools = Conversation.objects.values_list("last_client_tools", flat=True).get(pk=conversation_id) or []
        client_tools = {str(t.get("name")) for t in tools if isinstance(t, dict)}
        return pending_interaction([*self.messages(), *(extra or [])], client_tools)

    def is_idle(self) -> bool:
        """No turn of this conversation is queued or running."""
        from recovery.fibers import conversation_busy

        return not conversation_busy(self._require_conversation())

    def wait_until_stable(self, timeout: float | None = None) -> bool:
        """Wait until no turn runs and no human is pending; False when `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.is_idle() and not self.has_pending_interaction():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    async def await_stable(self, timeout: float | None = None) -> bool:
        """wait_until_stable for async callers (the recovery engine)."""
        from recovery.runtime import db

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if await db(self.is_idle) and not await db(self.has_pending_interaction):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)

    # -- entry paths: each runs its turn inside a recoverable fiber ---------------------------
    def save_messages(self, messages: Any, *, wait: bool = True, timeout: float | None = None) -> TurnResult:
        """Append messages (a list, or a function of the current transcript) and run a turn.

        Waits for a running turn to finish first. With `wait`, returns the outcome (`completed`, `error`,
        `aborted`), following any recovery of the turn; otherwise `accepted` at once.
        """
        from .handle import turn_start_programmatic, turn_wait

        conversation_id = self._require_conversation()
        started = turn_start_programmatic(conversation_id=conversation_id, messages=messages, timeout=timeout)
        if not wait:
            return started
        return turn_wait(conversation_id=conversation_id, request_id=started.request_id, timeout=timeout)

    def continue_last_turn(
        self,
        body: dict[str, Any] | None = None,
        *,
        wait: bool = False,
        timeout: float | None = None,
    ) -> TurnResult:
        """Continue the last assistant message in a new turn.

        The model is asked to go on where the message stopped; its answer is a new assistant message.
        Skipped (request id "") unless the last message is an assistant message.
        """
        from .handle import TurnResult, turn_wait
        from .transcript.services import turn_start_recovered

        conversation_id = self._require_conversation()
        started = turn_start_recovered(
            conversation_id=conversation_id,
            kind="continue",
            root_request_id="",
            incident_id=None,
            last_body=body,
        )
        if started.status == "skipped":
            return TurnResult("", "skipped")
        if not wait:
            return TurnResult(started.request_id, "accepted")
        return turn_wait(conversation_id=conversation_id, request_id=started.request_id, timeout=timeout)

    def submit_messages(
        self,
        messages: Any,
        *,
        submission_id: str | None = None,
        idempotency_key: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> SubmitResult:
        """Accept messages durably and run them as a turn when the conversation is free (idempotent)."""
        from .transcript.submissions import submission_create

        return submission_create(
            conversation_id=self._require_conversation(),
            messages=messages,
            submission_id=submission_id,
            idempotency_key=idempotency_key,
            metadata=metadata,
        )

    def cancel_submission(self, submission_id: str) -> bool:
        """Abort a pending or running submission; False when it had already ended."""
        from .transcript.submissions import submission_cancel

        return submission_cancel(conversation_id=self._require_conversation(), submission_id=submission_id)

    def get_submission(self, submission_id: str) -> Submission:
        from .transcript.submissions import submission_get

        return submission_get(conversation_id=self._require_conversation(), submission_id=submission_id)

    def list_submissions(self) -> list[Submission]:
        from .models import Submission

        return list(Submission.objects.filter(conversation_id=self._require_conversation()))

    def delete_submission(self, submission_id: str) -> bool:
        """Delete a finished submission (open ones are kept: False)."""
        from .transcript.submissions import submission_delete

        return submission_delete(conversation_id=self._require_conversation(), submission_id=submission_id)

    async def achat(
        self, messages: Any, *, on_chunk: ChunkCallback | None = None, timeout: float | None = None
    ) -> ChatResult:
        """Run a turn in this process, streaming each UI chunk to `on_chunk` (sync or async).

        The turn is durable like any other: if this process dies, recovery finishes it on a worker.
        """
        from .handle import chat_run

        return await chat_run(self, messages, on_chunk=on_chunk, timeout=timeout)

    def chat(
        self, messages: Any, *, on_chunk: ChunkCallback | None = None, timeout: float | None = None
    ) -> ChatResult:
        """achat() for synchronous callers (a view, a management command, a Celery task)."""
        from recovery import runtime

        return runtime.run(self.achat(messages, on_chunk=on_chunk, timeout=timeout))

    def stash(self, data: Any) -> None:
        """Keep JSON data with the running turn; recovery hands it back as `ctx.recovery_data`."""
        from recovery.fibers import fiber_stash

        turn = self.turn
        if turn is None:
            raise RuntimeError("stash() is only available while a turn of this agent runs")
        fiber_stash(fiber_id=turn.fiber_id, fencing=turn.fencing, data=data)

    async def astash(self, data: Any) -> None:
        from recovery.runtime import db

        await db(self.stash, data)


def current_agent() -> Think | None:
    """The agent whose turn is running in this context (tools use it to reach `stash`, say)."""
    return _current_agent.get()


_current_agent: ContextVar[Think | None] = ContextVar("think_current_agent", default=None)


def agent_names() -> list[str]:
    return list(think_setting("AGENTS"))


def agent_class(name: str) -> type[Think]:
    """The registered Think subclass for a URL agent name; raises UnknownAgent."""
    agents: dict[str, str] = think_setting("AGENTS")
    for registered, path in agents.items():
        if kebab(registered) == name:
            cls = import_string(path)
            if not (isinstance(cls, type) and issubclass(cls, Think)):
                raise UnknownAgent(name)
            return cls
    raise UnknownAgent(name)


def agent_for(agent: str, name: str, conversation_id: int | None = None) -> Think:
    return agent_class(agent)(agent=agent, name=name, conversation_id=conversation_id)


def open_agent(agent: str, name: str, *, owner: str | None = None) -> Think:
    """The agent of a conversation, created if new: the start of programmatic use.

    `open_agent("assistant", "support-42", owner=user_principal(request.user)).save_messages(["Hello"])`

    `owner` is the principal (chat.access) whose clients may open the conversation: a new or unowned
    conversation becomes theirs; one that belongs to someone else raises AccessDenied. Without it the
    conversation keeps its owner, and one created here has none (server code only).
    """
    from .exceptions import AccessDenied
    from .transcript.services import conversation_claim, conversation_get_or_create

    agent_class(agent)  # UnknownAgent before anything is written
    conversation = conversation_get_or_create(agent=agent, name=name, owner=owner or "")
    if (
        owner
        and conversation.owner != owner
        and not conversation_claim(conversation_id=conversation.pk, owner=owner)
    ):
        raise AccessDenied(f"conversation {agent}/{name} belongs to someone else")
    return agent_for(agent, name, conversation.pk)
