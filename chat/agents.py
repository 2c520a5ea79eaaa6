"""The agent API: the Think base class and the registry of agents by name."""

from __future__ import annotations

import re
from typing import Any

from django.utils.module_loading import import_string

from .conf import default_model, think_setting


def kebab(name: str) -> str:
    """The client's camelCase-to-kebab rule: `ChatAgent` -> `chat-agent`, `MY_AGENT` -> `my-agent`."""
    if name.isupper():
        return name.lower().replace("_", "-")
    converted = re.sub(r"[A-Z]", lambda m: "-" + m.group(0).lower(), name)
    return converted.lstrip("-").replace("_", "-").rstrip("-")


class Think:
    """A chat agent. Subclass it, override the hooks, and register it by name in THINK["AGENTS"].

    One instance is built per turn (and per recovery step) for one conversation, so instance state
    does not survive between turns: durable state belongs in the conversation's messages.
    """

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
