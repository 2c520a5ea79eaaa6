"""Conversations and their UIMessage transcripts."""

from __future__ import annotations

import uuid

from django.db import models

from .types import UIMessage


class Conversation(models.Model):
    """One agent instance: the pair (agent name, instance name) of the WebSocket URL."""

    agent = models.CharField(max_length=100)
    name = models.CharField(max_length=200)
    # The principal it belongs to (chat.access): "user:<pk>", "session:<hmac>", or what a custom access
    # policy uses; empty for a conversation server code created without one (no client may open it).
    owner = models.CharField(max_length=255, blank=True, default="", db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Request context kept for continuations and recovery (Think's lastBody / lastClientTools).
    last_body = models.JSONField(null=True, blank=True)
    last_client_tools = models.JSONField(null=True, blank=True)
    # {"requestId", "body"} of the last turn that ended in error while nobody may have seen it.
    last_terminal = models.JSONField(null=True, blank=True)
    # {"requestId", "at"} while a recovery is scheduled or running.
    recovering = models.JSONField(null=True, blank=True)
    # Monotonic progress counter credited at chunk-store time; the recovery budget reads it.
    progress = models.BigIntegerField(default=0)
    # Tool results and approvals that arrived while the turn that asked for them was still finishing;
    # the turn applies them when it stores its message.
    tool_updates = models.JSONField(default=list, blank=True)
    # The assistant message whose tool batch continues automatically once its last result arrives.
    continue_armed = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["agent", "name"], name="think_conversation_agent_name"),
        ]
        ordering = ["-updated_at"]

    def __str__(self) -> str:
        return f"{self.agent}/{self.name}"


class Message(models.Model):
    """A UIMessage (id, role, parts, metadata) at a position in its conversation."""

    class Role(models.TextChoices):
        USER = "user"
        ASSISTANT = "assistant"
        SYSTEM = "system"

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="messages")
    message_id = models.CharField(max_length=255)
    role = models.CharField(max_length=16, choices=Role.choices)
    parts = models.JSONField(default=list)
    metadata = models.JSONField(null=True, blank=True)
    position = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["conversation", "message_id"], name="think_message_unique_id"),
        ]
        indexes = [models.Index(fields=["conversation", "position"], name="think_message_position")]
        ordering = ["conversation", "position"]

    def __str__(self) -> str:
        return f"{self.role} {self.message_id}"

    def as_ui_message(self) -> UIMessage:
        message: UIMessage = {"id": self.message_id, "role": self.role, "parts": self.parts}
        if self.metadata is not None:
            message["metadata"] = self.metadata
        return message


class SubmissionQuerySet(models.QuerySet["Submission"]):
    def open(self) -> SubmissionQuerySet:
        return self.filter(status__in=[Submission.Status.PENDING, Submission.Status.RUNNING])


class Submission(models.Model):
    """A durable programmatic turn (`submit_messages`): accepted now, run when the conversation is free."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        COMPLETED = "completed"
        ABORTED = "aborted"
        SKIPPED = "skipped"
        ERROR = "error"

    TERMINAL = frozenset({Status.COMPLETED, Status.ABORTED, Status.SKIPPED, Status.ERROR})

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="submissions")
    submission_id = models.CharField(max_length=255)
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    request_id = models.CharField(max_length=255)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    messages = models.JSONField(default=list)
    metadata = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    messages_applied_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = SubmissionQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["conversation", "submission_id"], name="think_submission_id"),
            models.UniqueConstraint(
                fields=["conversation", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="think_submission_idempotency",
            ),
        ]
        indexes = [
            models.Index(
                fields=["conversation", "created_at"],
                name="think_submission_open",
                condition=models.Q(status__in=["pending", "running"]),
            )
        ]
        ordering = ["created_at", "submission_id"]

    def __str__(self) -> str:
        return f"submission {self.submission_id} ({self.status})"


class TurnCompletion(models.Model):
    """How a turn ended (the turn and every recovery that continued it), written in the transaction
    that ended it, then delivered once to `chat.signals.turn_completed` and the agent's
    `on_turn_completed` (chat.turn.deliveries), on whichever process ended it, or by the tick's sweep
    when that process died first."""

    class Ending(models.TextChoices):
        COMPLETED = "completed"  # it finished without an interruption
        RECOVERED = "recovered"  # it was interrupted, and recovery finished it
        EXHAUSTED = "exhausted"  # recovery gave up (the terminal message was sent)
        CANCELLED = "cancelled"  # a cancel, a stop of the conversation, or a clear
        FAILED = "failed"  # the model or the agent failed it, or recovery was declined
        SKIPPED = "skipped"  # it never ran to an answer: replaced by a newer request, or moved past

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="completions")
    request_id = models.CharField(max_length=255)  # the turn's own request id (its recovery chain's root)
    last_request_id = models.CharField(max_length=255)  # the request that ended it (a recovery's, maybe)
    ending = models.CharField(max_length=16, choices=Ending.choices)
    message_id = models.CharField(max_length=255, blank=True, default="")  # its answer, if it stored one
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    attempts = models.IntegerField(default=0)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["conversation", "request_id"], name="think_turn_completion"),
        ]
        indexes = [
            models.Index(
                fields=["created_at"],
                name="think_completion_undelivered",
                condition=models.Q(delivered_at=None),
            )
        ]
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"turn {self.request_id} {self.ending}"


class Branch(models.Model):
    """A branch of the conversation set aside: the messages that followed `anchor_message_id` on it (a
    regenerated answer, or what followed a user message before it was edited), with the compactions
    of their range. The branch in use is the Message table itself (chat.transcript.branches)."""

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="branches")
    anchor_message_id = models.CharField(max_length=255, blank=True, default="")  # "": the start
    # The anchor message's own creation: an edited user message keeps its id but is a new row, and the
    # alternatives set aside under its old version stay with that version (None: the start).
    anchor_created_at = models.DateTimeField(null=True, blank=True)
    messages = models.JSONField(default=list)  # UIMessages with their "createdAt" (ISO), in order
    compactions = models.JSONField(default=list)
    # When its first message was created: the alternatives after an anchor are numbered in this order.
    first_created_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["conversation", "anchor_message_id"], name="think_branch_anchor")]
        ordering = ["conversation", "first_created_at"]

    def __str__(self) -> str:
        return f"branch after {self.anchor_message_id or 'the start'} ({len(self.messages)} messages)"


class Compaction(models.Model):
    """An overlay that shows a summary in place of a range of messages; the messages themselves stay."""

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="compactions")
    compaction_id = models.CharField(max_length=64, unique=True)
    from_message_id = models.CharField(max_length=255)
    to_message_id = models.CharField(max_length=255)
    summary = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["conversation", "created_at"]

    def __str__(self) -> str:
        return f"compaction {self.from_message_id}..{self.to_message_id}"

    @property
    def message_id(self) -> str:
        return f"compaction_{self.compaction_id}"

    def as_ui_message(self) -> UIMessage:
        return {"id": self.message_id, "role": "assistant", "parts": [{"type": "text", "text": self.summary}]}


class PrincipalUsage(models.Model):
    """What one principal (chat.access) started and spent on one UTC day: the THINK["PRINCIPAL_*"] limits
    read it, and the admin shows it. Server code's conversations (no owner) are not counted."""

    principal = models.CharField(max_length=255)
    day = models.DateField()
    turns = models.PositiveIntegerField(default=0)  # chat requests accepted
    input_tokens = models.BigIntegerField(default=0)  # as the model reported them, per finished run
    output_tokens = models.BigIntegerField(default=0)  # as the model reported them, per finished run

    class Meta:
        db_table = "think_chat_principal_usage"
        verbose_name_plural = "principal usage"
        constraints = [models.UniqueConstraint(fields=["principal", "day"], name="think_principal_usage_day")]
        ordering = ["-day", "principal"]

    def __str__(self) -> str:
        return f"{self.principal} on {self.day}"


class TokenRevocation(models.Model):
    """Access tokens refused before they expire (chat.tokens): one token by its id, or (token_id empty)
    every token of `principal` issued before `not_before`."""

    token_id = models.CharField(max_length=64, blank=True, default="")
    principal = models.CharField(max_length=255, blank=True, default="")
    not_before = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "think_chat_token_revocation"
        constraints = [
            models.UniqueConstraint(
                fields=["token_id"], condition=~models.Q(token_id=""), name="think_token_revocation_id"
            ),
            models.UniqueConstraint(
                fields=["principal"], condition=models.Q(token_id=""), name="think_token_revocation_principal"
            ),
            models.CheckConstraint(
                condition=~models.Q(token_id="")
                | (~models.Q(principal="") & models.Q(not_before__isnull=False)),
                name="think_token_revocation_kind",
            ),
        ]

    def __str__(self) -> str:
        if self.token_id:
            return f"token {self.token_id}"
        return f"tokens of {self.principal} before {self.not_before}"


class ChatFile(models.Model):
    """A file a user attached to a message of a conversation (chat.transcript.files): its bytes are in
    Django's storage under `storage_name`, and the message's file part holds its URL (think_chat:file)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="files")
    # The principal who sent it (chat.access), for THINK["PRINCIPAL_FILE_BYTES_PER_DAY"].
    owner = models.CharField(max_length=255, blank=True, default="")
    storage_name = models.CharField(max_length=255)
    media_type = models.CharField(max_length=100)
    filename = models.CharField(max_length=255, blank=True, default="")
    size = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "think_chat_file"
        constraints = [
            models.UniqueConstraint(fields=["conversation", "sha256"], name="think_file_unique_content"),
        ]
        indexes = [models.Index(fields=["owner", "created_at"], name="think_file_owner_day")]

    def __str__(self) -> str:
        return f"{self.filename or self.id} ({self.media_type}, {self.size} bytes)"
