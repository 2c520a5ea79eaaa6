"""System checks for the THINK settings dict."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, register
from django.utils.module_loading import import_string

from .conf import think_setting


@register()
def check_think_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    agents = think_setting("AGENTS")
    if not isinstance(agents, dict) or not agents:
        return [
            Error("THINK['AGENTS'] must be a non-empty dict of name -> dotted path.", id="think_chat.E001")
        ]
    from .agents import Think, kebab

    for name, path in agents.items():
        if not isinstance(name, str) or kebab(name) != name:
            errors.append(
                Error(
                    f"Agent name {name!r} is not kebab-case.",
                    hint=f"Use {kebab(str(name))!r}: it is the name clients put in the URL.",
                    id="think_chat.E002",
                )
            )
        try:
            cls = import_string(path)
        except ImportError as exc:
            errors.append(Error(f"Agent {name!r}: cannot import {path!r}: {exc}", id="think_chat.E003"))
            continue
        if not (isinstance(cls, type) and issubclass(cls, Think)):
            errors.append(Error(f"Agent {name!r}: {path!r} is not a Think subclass.", id="think_chat.E004"))
    for key in ("FLUSH_EVERY_CHUNKS", "FLUSH_INTERVAL_MS", "LEASE_TTL_S", "HEARTBEAT_INTERVAL_S"):
        value = think_setting(key)
        if not isinstance(value, int | float) or value <= 0:
            errors.append(
                Error(f"THINK[{key!r}] must be a positive number, got {value!r}.", id="think_chat.E005")
            )
    if think_setting("HEARTBEAT_INTERVAL_S") >= think_setting("LEASE_TTL_S"):
        errors.append(
            Error(
                "THINK['HEARTBEAT_INTERVAL_S'] must be shorter than THINK['LEASE_TTL_S'].",
                hint="A lease that is renewed less often than it expires is always expired.",
                id="think_chat.E006",
            )
        )
    return errors
