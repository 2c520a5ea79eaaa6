"""What the recovery engine hands to an agent's on_chat_recovery hook, and what the hook answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChatRecoveryContext:
    """Everything known about an interrupted turn."""

    incident_id: str
    recovery_root_request_id: str
    attempt: int
    max_attempts: int
    recovery_kind: str  # "retry" (nothing was produced yet) or "continue"
    stream_id: str  # "" when the turn was interrupted before its stream opened
    request_id: str
    partial_text: str
    partial_parts: list[dict[str, Any]]
    recovery_data: Any  # what the turn stashed, or None
    messages: list[dict[str, Any]]
    last_body: dict[str, Any] | None
    last_client_tools: list[dict[str, Any]] | None
    created_at: int  # epoch ms when the interrupted fiber was created


@dataclass(frozen=True)
class ChatRecoveryOptions:
    """persist: keep the partial (settled tool results are kept regardless); continue_: resume the turn."""

    persist: bool = True
    continue_: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
