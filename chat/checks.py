"""System checks of the chat app: its keys of the THINK dict and the agents it names (the recovery
layer checks its own keys, recovery.checks)."""

from __future__ import annotations

import re
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.utils.module_loading import import_string

from .access import AccessPolicy
from .conf import think_setting
from .origins import origin_problem
from .secret_key import HINT as SECRET_KEY_HINT
from .secret_key import secret_key_problems
from .turn.agent import Think
from .turn.registry import kebab

POSITIVE_NUMBERS = ("STREAM_SILENCE_MS", "TOKEN_MAX_AGE_S", "MAX_FRAMES_PER_S", "QUEUED_NOTICE_MS")
POSITIVE_INTEGERS = (
    "MAX_NAME_LENGTH",
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_MESSAGE_PARTS",
    "MAX_TOOL_OUTPUT_BYTES",
    "MAX_QUEUED_TURNS",
    "MAX_FRAME_BURST",
    "MAX_SEND_BYTES",
    "MAX_NEW_MESSAGES",
    "MAX_BUFFERED_TOOL_UPDATES",
    "MAX_BUFFERED_TOOL_UPDATE_BYTES",
    "MAX_CLIENT_TOOLS_BYTES",
    "MAX_FILE_BYTES",
    "MAX_MESSAGE_FILES",
    "MAX_MODEL_FILE_BYTES",
    "WEB_DB_THREADS",
)


@register(Tags.security, deploy=True)
def check_secret_key(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """think_chat.E026: a public or guessable SECRET_KEY (chat/secret_key.py). Also refused at start-up
    whenever DEBUG is off (ChatConfig.ready)."""
    return [Error(problem, hint=SECRET_KEY_HINT, id="think_chat.E026") for problem in secret_key_problems()]


@register()
def check_think_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    return [
        *_check_agents(),
        *_check_numbers(),
        *_check_limits(),
        *_check_window(),
        *_check_principal_limits(),
        *_check_file_types(),
        *_check_access(),
        *_check_trusted_origins(),
        *_check_preload(),
    ]


def _check_preload() -> list[CheckMessage]:
    value = think_setting("PRELOAD_LITELLM")
    if value == "auto" or value is True or value is False:
        return []
    return [
        Error(
            f"THINK['PRELOAD_LITELLM'] must be \"auto\", True or False, got {value!r}.",
            hint="docs/operations.md, 'Start and litellm'.",
            id="think_chat.E028",
        )
    ]


def _check_trusted_origins() -> list[CheckMessage]:
    value = think_setting("TRUSTED_ORIGINS")
    if value is None:
        return []
    hint = 'Full origins a browser may open the chat socket from, e.g. ["https://app.example.com"].'
    if isinstance(value, str) or not isinstance(value, list | tuple):
        return [
            Error(
                f"THINK['TRUSTED_ORIGINS'] must be a list of origins, got {value!r}.",
                hint=hint,
                id="think_chat.E027",
            )
        ]
    return [
        Error(f"THINK['TRUSTED_ORIGINS']: {problem}.", hint=hint, id="think_chat.E027")
        for entry in value
        if (problem := origin_problem(entry)) is not None
    ]


PRINCIPAL_LIMITS = (
    "PRINCIPAL_MAX_ACTIVE_TURNS",
    "PRINCIPAL_TURNS_PER_MINUTE",
    "PRINCIPAL_TOKENS_PER_DAY",
    "PRINCIPAL_OUTPUT_TOKENS_PER_DAY",
    "ANONYMOUS_TURNS_PER_MINUTE_PER_ADDRESS",
    "PRINCIPAL_MAX_SOCKETS",
    "ANONYMOUS_SOCKETS_PER_ADDRESS",
    "PRINCIPAL_MAX_CONVERSATIONS",
    "ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS",
    "PRINCIPAL_REPLAYS_PER_MINUTE",
    "PRINCIPAL_FILE_BYTES_PER_DAY",
    "ANONYMOUS_FILE_BYTES_PER_DAY_PER_ADDRESS",
)


def _check_principal_limits() -> list[CheckMessage]:
    return [
        Error(
            f"THINK[{key!r}] must be None (no limit) or a positive integer, got {value!r}.",
            hint="A limit per principal over all their conversations (README, Limits).",
            id="think_chat.E024",
        )
        for key in PRINCIPAL_LIMITS
        if (value := think_setting(key)) is not None
        and not (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    ]


_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9.+-]*/[a-z0-9][a-z0-9.+-]*")


def _check_file_types() -> list[CheckMessage]:
    types = think_setting("FILE_TYPES")
    valid = isinstance(types, list | tuple) and all(
        isinstance(t, str) and _MEDIA_TYPE.fullmatch(t) for t in types
    )
    if valid:
        return []
    return [
        Error(
            f"THINK['FILE_TYPES'] must be a list of lower-case media types, got {types!r}.",
            hint="The types of the files users may attach, for example ['image/png', 'application/pdf'] "
            "(chat.transcript.files; an empty list accepts none).",
            id="think_chat.E030",
        )
    ]


def _check_access() -> list[CheckMessage]:

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
            continue
        errors.extend(cls.check(label=name))
        if cls.get_model is Think.get_model and cls.model is None and not think_setting("MODEL"):
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


# daphne's websocket_max_message_size is 1 MiB: autobahn refuses to send a longer message, and daphne
# closes the socket with 1011. A window must leave room for the frame around it.
WINDOW_CEILING = 900_000


def _check_window() -> list[CheckMessage]:
    window = think_setting("TRANSCRIPT_WINDOW_BYTES")
    if not (isinstance(window, int) and not isinstance(window, bool) and 0 < window <= WINDOW_CEILING):
        return [
            Error(
                f"THINK['TRANSCRIPT_WINDOW_BYTES'] must be an integer from 1 to {WINDOW_CEILING},"
                f" got {window!r}.",
                hint="The transcript clients are sent must stay under daphne's 1 MiB WebSocket message "
                "limit (docs/protocol.md, Long conversations).",
                id="think_chat.E025",
            )
        ]
    frame, message = think_setting("MAX_FRAME_BYTES"), think_setting("MAX_MESSAGE_BYTES")
    valid = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (frame, message))
    if valid and 2 * window + message > frame:  # (bad limits are E007's)
        return [
            CheckWarning(
                f"THINK['TRANSCRIPT_WINDOW_BYTES'] ({window}) is too large for MAX_FRAME_BYTES ({frame}): a "
                "client echoing the window in a chat request (JSON in a JSON string: up to twice its size) "
                f"plus a new message of MAX_MESSAGE_BYTES ({message}) would be refused.",
                hint="Keep 2 * TRANSCRIPT_WINDOW_BYTES + MAX_MESSAGE_BYTES <= MAX_FRAME_BYTES.",
                id="think_chat.W025",
            )
        ]
    return []


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
