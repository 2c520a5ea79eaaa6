"""System checks of the chat app: its keys of the THINK dict and the agents it names (the recovery
layer checks its own keys, recovery.checks)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, register
from django.utils.module_loading import import_string

from .conf import think_setting

POSITIVE_NUMBERS = ("STREAM_SILENCE_MS", "TOKEN_MAX_AGE_S", "MAX_FRAMES_PER_S")
POSITIVE_INTEGERS = (
    "MAX_NAME_LENGTH",
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_MESSAGE_PARTS",
    "MAX_TOOL_OUTPUT_BYTES",
    "MAX_QUEUED_TURNS",
    "MAX_FRAME_BURST",
)


@register()
def check_think_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    return [*_check_agents(), *_check_numbers(), *_check_limits(), *_check_access()]


def _check_access() -> list[CheckMessage]:
    from .access import AccessPolicy

    errors: list[CheckMessage] = []
    path = think_setting("ACCESS_POLICY")
    try:
        cls = import_string(path) if isinstance(path, str) else None
    except ImportError as exc:
        errors.append(Error(f"THINK['ACCESS_POLICY']: cannot import {path!r}: {exc}", id="think_chat.E008"))
    else:
        if not (isinstance(cls, type) and issubclass(cls, AccessPolicy)):
            errors.append(
                Error(
                    f"THINK['ACCESS_POLICY'] must name an AccessPolicy subclass, got {path!r}.",
                    hint="chat.access.UserAccess (logins and tokens), chat.access.SessionAccess (anonymous "
                    "visitors too) or your own subclass of chat.access.AccessPolicy.",
                    id="think_chat.E008",
                )
            )
    return errors


def _check_agents() -> list[CheckMessage]:
    agents = think_setting("AGENTS")
    if not isinstance(agents, dict) or not agents:
        return [
            Error("THINK['AGENTS'] must be a non-empty dict of name -> dotted path.", id="think_chat.E001")
        ]
    from .agents import Think, kebab

    errors: list[CheckMessage] = []
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
        elif cls.get_model is Think.get_model and not think_setting("MODEL"):
            errors.append(
                Error(
                    f"Agent {name!r} has no model: THINK['MODEL'] is not set and {path} does not override"
                    " get_model().",
                    hint="Set THINK['MODEL'] to a litellm model (for example 'openai/gpt-4o-mini').",
                    id="think_chat.E011",
                )
            )
    return errors


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _check_numbers() -> list[CheckMessage]:
    return [
        Error(f"THINK[{key!r}] must be a positive number, got {value!r}.", id="think_chat.E005")
        for key in POSITIVE_NUMBERS
        if not _positive_number(value := think_setting(key))
    ]


def _check_limits() -> list[CheckMessage]:
    return [
        Error(
            f"THINK[{key!r}] must be a positive integer, got {value!r}.",
            hint="It is a limit on client input (see the Limits section of the README).",
            id="think_chat.E007",
        )
        for key in POSITIVE_INTEGERS
        if not (isinstance(value := think_setting(key), int) and not isinstance(value, bool) and value > 0)
    ]
