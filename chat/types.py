"""The shapes that travel through chat as JSON: AI SDK UI messages, their parts, and UI message stream
chunks (the v6 chunk set, which both client majors read; chat.turn.chunking makes them).

Types only: this module imports nothing from Django or the apps, so every layer may use it, the wire
codec (chat.protocol) included.

Code reads and updates parts by key, often with keys it picks at run time, so a part travels as `Part`,
a plain dict; the per-kind TypedDicts below say what each kind holds. A `Chunk` is one TypedDict with
`type` and every key some chunk type carries.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, Required, TypedDict

Metadata = dict[str, Any]

# Any part of a message; its `type` says which of the kinds below it is.
Part = dict[str, Any]

ToolState = Literal[
    "input-streaming",
    "input-available",
    "approval-requested",
    "approval-responded",
    "output-available",
    "output-error",
    "output-denied",
]


class UIMessage(TypedDict):
    """One message of a transcript, as clients hold it and the Message table stores it."""

    id: str
    role: str  # "user", "assistant" or "system"
    parts: list[Part]
    # The sender's own keys, and the server's: usage (the finish chunk's), thinkTruncated (a copy cut for
    # display, chat.transcript.window), thinkBranch (alternatives follow, chat.transcript.branches).
    metadata: NotRequired[Metadata | None]


# -- the kinds of part -------------------------------------------------------------------------------
class TextPart(TypedDict):
    type: Literal["text"]
    text: str
    state: NotRequired[Literal["streaming", "done"]]
    providerMetadata: NotRequired[dict[str, Any]]


class ReasoningPart(TypedDict):
    type: Literal["reasoning"]
    text: str
    state: NotRequired[Literal["streaming", "done"]]
    providerMetadata: NotRequired[dict[str, Any]]


class StepStartPart(TypedDict):
    """Where a model step begins (an assistant message holds one per step)."""

    type: Literal["step-start"]


class Approval(TypedDict, total=False):
    """A tool part's approval: asked for (`id`), then answered (`approved`, and maybe `reason`)."""

    id: Required[str]
    approved: bool
    reason: str


class ToolPart(TypedDict):
    """A tool call: `type` is `tool-<name>` for a tool known in advance, `dynamic-tool` (with
    `toolName`) for one known only at run time (an MCP server's)."""

    type: str
    toolCallId: str
    state: ToolState
    input: Any
    toolName: NotRequired[str]
    title: NotRequired[str]
    providerExecuted: NotRequired[bool]
    output: NotRequired[Any]
    preliminary: NotRequired[bool]
    errorText: NotRequired[str]
    approval: NotRequired[Approval]


class FilePart(TypedDict):
    """A file: `url` is the server's file URL (chat.transcript.files), or a data URL stored before
    files were kept apart."""

    type: Literal["file"]
    mediaType: str
    url: str
    filename: NotRequired[str]


class SourceUrlPart(TypedDict):
    type: Literal["source-url"]
    sourceId: str
    url: str
    title: NotRequired[str]


class SourceDocumentPart(TypedDict):
    type: Literal["source-document"]
    sourceId: str
    mediaType: str
    title: str
    filename: NotRequired[str]


class DataPart(TypedDict):
    """`type` is `data-<name>`; a later chunk with the same type and `id` replaces its `data`."""

    type: str
    data: Any
    id: NotRequired[str]


# What a Part is, kind by kind.
KnownPart = (
    TextPart
    | ReasoningPart
    | StepStartPart
    | ToolPart
    | FilePart
    | SourceUrlPart
    | SourceDocumentPart
    | DataPart
)


# -- stream chunks -----------------------------------------------------------------------------------
class Chunk(TypedDict, total=False):
    """One UI message stream chunk: its `type` (`start`, `text-delta`, `tool-input-available`,
    `data-<name>`, `finish`, ...) and the keys that type carries."""

    type: Required[str]
    # start, finish, message-metadata
    messageId: str
    messageMetadata: Metadata
    finishReason: str  # stop, length, content-filter, tool-calls, error, other
    # text-*, reasoning-* (the part's id); data-<name> (the id a later chunk replaces)
    id: str
    delta: str
    providerMetadata: dict[str, Any]
    # tool-*
    toolCallId: str
    toolName: str
    inputTextDelta: str
    input: Any
    output: Any
    errorText: str  # also `error`
    approvalId: str
    preliminary: bool
    providerExecuted: bool
    dynamic: bool
    title: str  # also source-*
    # source-url, source-document, file
    sourceId: str
    url: str
    mediaType: str
    filename: str
    # data-<name>: `transient` ones reach clients but are never part of the message
    data: Any
    transient: bool
    # abort
    reason: str
