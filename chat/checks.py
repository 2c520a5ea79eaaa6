"""System checks of the chat app: its keys of the THINK dict and the agents it names (the recovery
layer checks its own keys, recovery.checks)."""

from __future__ import annotations

import importlib.util
import inspect
import re
from collections.abc import Sequence
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.utils.module_loading import import_string

from recovery.incidents import ChatRecovery

from .access import AccessPolicy
from .agents import MESSAGE_CONCURRENCY_POLICIES, Think, kebab, plain_attribute
from .conf import think_setting
from .origins import origin_problem
from .secret_key import HINT as SECRET_KEY_HINT
from .secret_key import secret_key_problems
from .turn.mcp import MCPServer
from .turn.overflow import ContextOverflow
from .turn.pricing import ModelPrices
from .turn.tools import Tool

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


def think_class_errors(cls: type[Think], *, label: str) -> list[CheckMessage]:
    """What is wrong with an agent class's options and hooks (Think.check)."""
    found: list[tuple[str, str, str | None]] = [*_option_errors(cls), *_hook_errors(cls)]
    return [
        Error(f"Agent {label!r} ({cls.__qualname__}): {message}", hint=hint, obj=cls, id=error_id)
        for message, error_id, hint in found
    ]


def _option_errors(cls: type[Think]) -> list[tuple[str, str, str | None]]:
    found: list[tuple[str, str, str | None]] = []
    stall = cls.chat_stream_stall_timeout_ms
    if isinstance(stall, bool) or not isinstance(stall, int) or stall < 0:
        found.append(
            (f"chat_stream_stall_timeout_ms must be an int >= 0 (0 = off), got {stall!r}.", "E012", None)
        )
    steps = cls.max_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        found.append((f"max_steps must be an int >= 1, got {steps!r}.", "E013", None))
    if cls.message_concurrency not in MESSAGE_CONCURRENCY_POLICIES:
        policy = cls.message_concurrency
        found.append(
            (f"message_concurrency must be 'queue', 'latest' or 'drop', got {policy!r}.", "E014", None)
        )
    if not isinstance(cls.chat_recovery, ChatRecovery | bool | None):
        recovery = cls.chat_recovery
        found.append(
            (f"chat_recovery must be a ChatRecovery, True, False or None, got {recovery!r}.", "E015", None)
        )
    overflow = cls.context_overflow
    if not isinstance(overflow, ContextOverflow | None):
        found.append((f"context_overflow must be a ContextOverflow or None, got {overflow!r}.", "E016", None))
    elif overflow is not None and not _compacts(cls):
        hint = "Set `compaction = create_compact_function()` (or session.on_compaction in configure_session)."
        found.append(("context_overflow needs a compaction function, and the agent has none.", "E017", hint))
    compaction = plain_attribute(cls, "compaction")
    if compaction is not None and not callable(compaction):
        found.append((f"compaction must be a function or None, got {compaction!r}.", "E018", None))
    tools = cls.tools
    if not _tool_list(tools):
        found.append(
            (f"tools must be a list of Tool objects (made with @tool), got {tools!r}.", "E019", None)
        )
    else:
        hint = "Annotate its parameters with types pydantic can validate, or pass parameters={...}."
        found.extend((f"{t.schema_error}.", "E029", hint) for t in tools if t.schema_error is not None)
    servers = cls.mcp_servers
    if (
        isinstance(servers, str | bytes)
        or not isinstance(servers, Sequence)
        or not all(isinstance(item, MCPServer) for item in servers)
    ):
        found.append((f"mcp_servers must be a list of MCPServer objects, got {servers!r}.", "E031", None))
    elif servers and importlib.util.find_spec("mcp") is None:
        hint = "pip install 'thinkproject[mcp]' (the official MCP SDK)."
        found.append(("mcp_servers needs the mcp package, which is not installed.", "E031", hint))
    model = cls.model
    if not (
        model is None or (isinstance(model, str) and model) or (isinstance(model, dict) and "model" in model)
    ):
        found.append((f"model must be a model string or a dict with 'model', got {model!r}.", "E020", None))
    if not isinstance(cls.system_prompt, str | None):
        found.append((f"system_prompt must be a string or None, got {cls.system_prompt!r}.", "E021", None))
    if not isinstance(cls.model_prices, ModelPrices | None):
        found.append(
            (
                f"model_prices must be a ModelPrices or None, got {cls.model_prices!r}.",
                "E024",
                "ModelPrices(input=Decimal('0.000003'), output=Decimal('0.000015')): prices per token.",
            )
        )
    return [(message, f"think_chat.{error_id}", hint) for message, error_id, hint in found]


def _hook_errors(cls: type[Think]) -> list[tuple[str, str, str | None]]:
    found: list[tuple[str, str, str | None]] = []
    if inspect.iscoroutinefunction(cls.should_keep_recovering):
        found.append(("should_keep_recovering must be synchronous (not async def).", "think_chat.E022", None))
    classifier = inspect.getattr_static(cls, "classify_chat_error")
    if inspect.isfunction(classifier) and next(iter(inspect.signature(classifier).parameters), "") != "self":
        found.append(
            (
                "classify_chat_error is a plain function in the class body: it would be called as a method.",
                "think_chat.E023",
                "Define `def classify_chat_error(self, error, ctx)`, or assign one of the callable "
                "classifiers (default_chat_error_classifier, default_context_overflow_classifier).",
            )
        )
    return found


def _tool_list(tools: Any) -> bool:
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        return False
    return all(isinstance(item, Tool) for item in tools)


def _compacts(cls: type[Think]) -> bool:
    """Whether the agent can compact: a compaction function, or its own session set-up or getter."""
    return (
        plain_attribute(cls, "compaction") is not None
        or cls.configure_session is not Think.configure_session
        or cls.get_compaction is not Think.get_compaction
    )
