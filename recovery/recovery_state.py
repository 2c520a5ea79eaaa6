"""What the engine reads about an interrupted turn, and the small writes it makes (sync, DB threads)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from chat.folding import MessageAccumulator
from chat.interactions import foreign_updates_apply
from chat.models import Conversation
from chat.selectors import messages_list, stream_partial
from chat.services import interactions_settle, message_place

from .incidents import RECOVERING_FLAG_TTL_MS
from .models import Fiber, Stream
from .stream import stream_close


def unwrap_snapshot(snapshot: Any) -> tuple[dict[str, Any] | None, Any]:
    """(chat snapshot, user stash); anything that is not our envelope gives no snapshot."""
    if not isinstance(snapshot, dict) or "chat" not in snapshot:
        return None, snapshot
    chat = snapshot["chat"]
    valid = (
        isinstance(chat, dict)
        and chat.get("version") == 1
        and chat.get("kind") == "think-chat-turn"
        and isinstance(chat.get("requestId"), str)
        and isinstance(chat.get("continuation"), bool)
    )
    return (chat if valid else None), snapshot.get("user")


@dataclass
class RecoveryTarget:
    fiber: Fiber
    conversation: Conversation
    snapshot: dict[str, Any] | None
    recovery_data: Any
    stream: Stream | None
    partial: MessageAccumulator
    last_seq: int
    messages: list[dict[str, Any]]

    @property
    def request_id(self) -> str:
        return self.fiber.request_id

    @property
    def root_request_id(self) -> str:
        root = (self.snapshot or {}).get("recoveryRootRequestId")
        return root if isinstance(root, str) and root else self.fiber.request_id

    @property
    def latest_user_message_id(self) -> str | None:
        value = (self.snapshot or {}).get("latestUserMessageId")
        return value if isinstance(value, str) else None

    @property
    def stream_terminal(self) -> bool:
        return self.stream is not None and self.stream.status in (
            Stream.Status.COMPLETED,
            Stream.Status.ERROR,
        )

    @property
    def stream_was_open(self) -> bool:
        return self.stream is not None and not self.stream_terminal

    @property
    def kind(self) -> str:
        """retry when nothing was produced and the user message is unanswered, else continue.

        Unlike the reference, a stream that was opened but stayed empty is a retry too (#2105/#2276):
        a continuation would find the user message as the leaf and silently drop the turn.
        """
        snapshot = self.snapshot
        if snapshot is None or snapshot.get("continuation") or self.stream_terminal:
            return "continue"
        leaf = self.messages[-1] if self.messages else None
        unanswered = (
            self.latest_user_message_id is not None
            and leaf is not None
            and leaf["role"] == "user"
            and leaf["id"] == self.latest_user_message_id
        )
        return "retry" if unanswered and not self.partial.has_content else "continue"

    @property
    def last_body(self) -> dict[str, Any] | None:
        return (self.snapshot or {}).get("lastBody", self.conversation.last_body)

    @property
    def last_client_tools(self) -> list[dict[str, Any]] | None:
        return (self.snapshot or {}).get("lastClientTools", self.conversation.last_client_tools)

    @property
    def created_at_ms(self) -> int:
        return int(self.fiber.created_at.timestamp() * 1000)


def load_target(*, fiber_id: Any) -> RecoveryTarget | None:
    """Load an interrupted fiber with its stream, partial and transcript; None if it is not interrupted."""
    fiber = (
        Fiber.objects.filter(pk=fiber_id, status=Fiber.Status.INTERRUPTED)
        .select_related("conversation")
        .first()
    )
    if fiber is None:
        return None
    snapshot, stash = unwrap_snapshot(fiber.snapshot)
    stream = Stream.objects.filter(fiber=fiber).order_by("-created_at").first()
    partial, last_seq = stream_partial(stream) if stream is not None else (MessageAccumulator(""), -1)
    return RecoveryTarget(
        fiber=fiber,
        conversation=fiber.conversation,
        snapshot=snapshot,
        recovery_data=stash,
        stream=stream,
        partial=partial,
        last_seq=last_seq,
        messages=messages_list(conversation_id=fiber.conversation_id),
    )


def orphan_persist(
    *, target: RecoveryTarget, persist: bool, status: str = Stream.Status.COMPLETED
) -> list[dict[str, Any]]:
    """Store the partial under the stream's message id (if asked and non-empty) and close the stream."""
    assert target.stream is not None
    with transaction.atomic():
        Conversation.objects.select_for_update().filter(pk=target.conversation.pk).first()
        conversation = Conversation.objects.get(pk=target.conversation.pk)
        if persist and target.partial.has_content:
            after = (target.snapshot or {}).get("latestMessageId")
            message_place(
                conversation_id=conversation.pk, message=target.partial.message(), after_message_id=after
            )
        # Results of approved tools the dead turn ran belong to an earlier message: always kept.
        foreign_updates_apply(conversation_id=conversation.pk, updates=target.partial.foreign_tool_updates)
        interactions_settle(conversation)
        conversation.save(update_fields=["tool_updates", "continue_armed", "updated_at"])
        stream_close(stream_id=target.stream.pk, status=status)
    return messages_list(conversation_id=target.conversation.pk)


def fiber_mark_recovered(*, fiber_id: Any) -> None:
    Fiber.objects.filter(pk=fiber_id, status=Fiber.Status.INTERRUPTED).update(
        status=Fiber.Status.RECOVERED, finished_at=Now(), lease_expires_at=None
    )


def recovering_flag_active(flag: Any, *, now_ms: int) -> bool:
    """A recovering flag older than RECOVERING_FLAG_TTL_MS is treated as absent."""
    if not isinstance(flag, dict):
        return False
    at = flag.get("at")
    return isinstance(at, int | float) and now_ms - at <= RECOVERING_FLAG_TTL_MS


def conversation_set_recovering(*, conversation_id: int, request_id: str | None) -> bool:
    """Set or clear the recovering flag; True when that changed it."""
    with transaction.atomic():
        conversation = Conversation.objects.select_for_update().get(pk=conversation_id)
        active = recovering_flag_active(conversation.recovering, now_ms=int(time.time() * 1000))
        if active == (request_id is not None):
            return False
        conversation.recovering = (
            {"requestId": request_id, "at": int(time.time() * 1000)} if request_id is not None else None
        )
        conversation.save(update_fields=["recovering", "updated_at"])
    return True


def conversation_set_terminal(*, conversation_id: int, request_id: str, body: str) -> None:
    Conversation.objects.filter(pk=conversation_id).update(
        last_terminal={"requestId": request_id, "body": body}
    )
