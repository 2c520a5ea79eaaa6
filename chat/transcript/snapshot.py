"""What a chat turn's fiber records before the model is called: its kind and its snapshot.

A fiber's snapshot is one JSON value in Postgres: `{"chat": <the turn>, "user": <stash>, "reattach":
<provider cursor>, "trace": <trace context>}`. The chat app writes it whole when it creates the fiber, so
that even a turn that dies before its first chunk can be recovered; while the turn runs, the recovery
layer patches only its three slots in SQL (`recovery.lease.fibers.STASH_SLOT`, `CURSOR_SLOT`, `TRACE_SLOT`).
This module is the one owner of the keys: everyone else reads and writes a snapshot through
`TurnSnapshot` and `FiberSnapshot`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from django.db import models

from recovery.lease.fibers import CURSOR_SLOT, STASH_SLOT, TRACE_SLOT


class TurnKind(models.TextChoices):
    """What a chat fiber runs (its `kind` column; the recovery layer never reads it)."""

    CHAT = "chat"  # a client's request over the WebSocket
    CONTINUE = "continue"  # extends the last assistant message: recovery, tool results, approvals
    RETRY = "retry"  # answers an unanswered user message again
    PROGRAMMATIC = "programmatic"  # save_messages, chat(), durable submissions


TURN_SLOT = "chat"  # the chat app's part of the envelope
SNAPSHOT_KIND = "think-chat-turn"
SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class TurnSnapshot:
    """The chat turn a fiber runs, as it stood when the fiber was created."""

    request_id: str
    continuation: bool
    recovery_root_request_id: str = ""  # the first request of a chain of continuations
    latest_message_id: str | None = None  # the transcript's leaf when the turn was accepted
    latest_message_role: str | None = None
    latest_user_message_id: str | None = None
    started_at: str = ""  # ISO 8601
    last_body: dict[str, Any] | None = None  # the client's request context (Think's lastBody)
    last_client_tools: list[dict[str, Any]] | None = None
    incident_id: str | None = None  # set on a recovery's continuation or retry
    submission_id: str | None = None  # set on the turn of a durable submission
    owner_channel: str | None = None  # the connection that answered the tool this turn continues
    # A recovery's turn: the trace contexts of the attempt that started it and of the run it recovers
    # (chat.turn.tracing), {"attempt": carrier, "recovers": carrier}.
    recovery_trace: dict[str, Any] | None = None

    @property
    def root_request_id(self) -> str:
        return self.recovery_root_request_id or self.request_id

    @property
    def extends_assistant_message(self) -> str | None:
        """The assistant message a continuation stores into (None: the turn writes a new message)."""
        if self.continuation and self.latest_message_role == "assistant":
            return self.latest_message_id
        return None

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {"kind": SNAPSHOT_KIND, "version": SNAPSHOT_VERSION}
        for name, key in _KEYS.items():
            field_value = getattr(self, name)
            if field_value is not None or name not in _OMITTED_WHEN_NONE:
                value[key] = field_value
        return value

    @classmethod
    def from_json(cls, value: Any) -> TurnSnapshot | None:
        """The turn of a stored snapshot's chat part; None for anything this version did not write."""
        valid = (
            isinstance(value, dict)
            and value.get("version") == SNAPSHOT_VERSION
            and value.get("kind") == SNAPSHOT_KIND
            and isinstance(value.get("requestId"), str)
            and isinstance(value.get("continuation"), bool)
        )
        if not valid:
            return None
        known = {name: value[key] for name, key in _KEYS.items() if key in value}
        return cls(**known)

    def envelope(self, *, cursor: Any = None) -> dict[str, Any]:
        """The whole fiber snapshot to store; `cursor` is a provider cursor the turn starts from."""
        value: dict[str, Any] = {TURN_SLOT: self.to_json(), STASH_SLOT: None}
        if cursor is not None:
            value[CURSOR_SLOT] = cursor
        return value

    def replace(self, **changes: Any) -> TurnSnapshot:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def lookup(name: str) -> str:
        """The ORM lookup of one field in Fiber.snapshot: `Fiber.objects.filter(**{lookup(f): v})`."""
        return f"snapshot__{TURN_SLOT}__{_KEYS[name]}"


# The stored JSON keys, by field: they are what existing databases hold, so they never change.
_KEYS = {
    "request_id": "requestId",
    "recovery_root_request_id": "recoveryRootRequestId",
    "continuation": "continuation",
    "latest_message_id": "latestMessageId",
    "latest_message_role": "latestMessageRole",
    "latest_user_message_id": "latestUserMessageId",
    "started_at": "startedAt",
    "last_body": "lastBody",
    "last_client_tools": "lastClientTools",
    "incident_id": "incidentId",
    "submission_id": "submissionId",
    "owner_channel": "ownerChannel",
    "recovery_trace": "recoveryTrace",
}
_OMITTED_WHEN_NONE = {"incident_id", "submission_id", "owner_channel", "recovery_trace"}


@dataclass(frozen=True)
class FiberSnapshot:
    """A fiber's stored snapshot, read: the chat turn (None when the value is not a chat turn's), what the
    turn stashed for its recovery, the provider cursor its segment writes recorded, and the trace context
    its run recorded."""

    turn: TurnSnapshot | None
    stash: Any = None
    cursor: Any = None
    trace: Any = None

    @classmethod
    def from_json(cls, value: Any) -> FiberSnapshot:
        if not isinstance(value, dict) or TURN_SLOT not in value:
            return cls(None, value)  # not our envelope: the whole value is the owner's data
        turn = TurnSnapshot.from_json(value[TURN_SLOT])
        return cls(turn, value.get(STASH_SLOT), value.get(CURSOR_SLOT), value.get(TRACE_SLOT))
