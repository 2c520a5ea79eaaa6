"""The registry of agents: THINK["AGENTS"] by name, and the names of conversations.

An agent is registered under a name in THINK["AGENTS"] ({"Assistant": "myapp.agents.Assistant"}); the
URL names it in kebab case (`assistant`), as the published client does. `agent_class()` imports it and
runs its checks once, `agent_for()` builds the instance a turn runs.
"""

from __future__ import annotations

import re

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from ..conf import think_setting
from ..exceptions import UnknownAgent
from .agent import Think


def kebab(name: str) -> str:
    """The client's camelCase-to-kebab rule: `ChatAgent` -> `chat-agent`, `MY_AGENT` -> `my-agent`."""
    if name.isupper():
        return name.lower().replace("_", "-")
    converted = re.sub(r"[A-Z]", lambda m: "-" + m.group(0).lower(), name)
    converted = converted[1:] if converted.startswith("-") else converted
    converted = converted.replace("_", "-")
    return converted[:-1] if converted.endswith("-") else converted


def agent_names() -> list[str]:
    return list(think_setting("AGENTS"))


_checked: set[type[Think]] = set()


def agent_class(name: str) -> type[Think]:
    """The registered Think subclass for a URL agent name; raises UnknownAgent, and ImproperlyConfigured
    for an agent whose configuration `manage.py check` would refuse."""
    agents: dict[str, str] = think_setting("AGENTS")
    for registered, path in agents.items():
        if kebab(registered) == name:
            cls = import_string(path)
            if not (isinstance(cls, type) and issubclass(cls, Think)):
                raise UnknownAgent(name)
            if cls not in _checked:
                errors = [m for m in cls.check(label=registered) if m.is_serious()]
                if errors:
                    raise ImproperlyConfigured("; ".join(f"{m.msg} ({m.id})" for m in errors))
                _checked.add(cls)
            return cls
    raise UnknownAgent(name)


def agent_for(agent: str, name: str, conversation_id: int | None = None) -> Think:
    return agent_class(agent)(agent=agent, name=name, conversation_id=conversation_id)


def server_tool_names(agent: str, name: str, conversation_id: int) -> set[str]:
    """The names of the agent's server tools for a conversation (`Think.get_tools()`): a client's
    answer for one of their calls is refused (chat.transcript.interactions)."""
    return {tool.name for tool in agent_for(agent, name, conversation_id).get_tools()}


def conversation_name_problem(name: str) -> str | None:
    """What is wrong with a conversation name (None when nothing is): it must be 1 to
    THINK["MAX_NAME_LENGTH"] characters, none of them a control character (Postgres stores no NUL)."""
    limit = think_setting("MAX_NAME_LENGTH")
    if not 0 < len(name) <= limit:
        return f"a conversation name has 1 to {limit} characters"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a conversation name holds no control characters"
    return None
