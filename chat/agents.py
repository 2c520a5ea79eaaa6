"""The agent API: the Think base class and the registry of agents by name."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, ClassVar

from django.utils.module_loading import import_string

from recovery.context import ChatRecoveryContext, ChatRecoveryOptions
from recovery.incidents import ChatRecovery

from .conf import default_model, think_setting
from .loop import StepResult
from .repair import default_repair, pending_interaction
from .tools import Tool, tool

__all__ = [
    "Assistant",
    "ChatRecovery",
    "ChatRecoveryContext",
    "ChatRecoveryOptions",
    "StepResult",
    "Think",
    "Tool",
    "UnknownAgent",
    "agent_class",
    "agent_for",
    "kebab",
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

    #: Recovery budget and give-up behaviour (SPEC §1). Recovery cannot be switched off.
    chat_recovery: ClassVar[ChatRecovery | bool | None] = True
    #: Abort a stream silent for this long and recover it (0 = off).
    chat_stream_stall_timeout_ms: ClassVar[int] = 0
    #: Model steps per turn: each step after the first follows server tool results.
    max_steps: ClassVar[int] = 10

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
        if not isinstance(cls.chat_recovery, ChatRecovery | bool | None):
            raise TypeError(f"{cls.__name__}.chat_recovery must be a ChatRecovery, got {cls.chat_recovery!r}")

    def __init__(self, *, agent: str, name: str, conversation_id: int | None = None) -> None:
        self.agent = agent
        self.name = name
        self.conversation_id = conversation_id

    def get_model(self) -> str | dict[str, Any]:
        """A litellm model string, or a dict of litellm completion kwargs (model, api_base, ...)."""
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
        from .selectors import messages_list

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
        from recovery.models import Fiber

        return not Fiber.objects.filter(conversation_id=self._require_conversation()).active().exists()

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

    def continue_last_turn(
        self,
        body: dict[str, Any] | None = None,
        *,
        root_request_id: str | None = None,
        incident_id: str | None = None,
    ) -> Any:
        """Start a durable turn that continues the last assistant message (skipped unless it is the leaf)."""
        from recovery.models import Fiber

        from .services import turn_start_recovered

        return turn_start_recovered(
            conversation_id=self._require_conversation(),
            kind=Fiber.Kind.CONTINUE,
            root_request_id=root_request_id or "",
            incident_id=incident_id,
            last_body=body,
        )


class Assistant(Think):
    """The demo agent: the configured model (the scripted model by default) and a short system prompt."""

    def get_system_prompt(self) -> str | None:
        return "You are a helpful assistant."


class UnknownAgent(LookupError):
    pass


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
