"""Conversations and their UIMessage transcripts."""

from __future__ import annotations

from django.db import models


class Conversation(models.Model):
    """One agent instance: the pair (agent name, instance name) of the WebSocket URL."""

    agent = models.CharField(max_length=100)
    name = models.CharField(max_length=200)
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

    def as_ui_message(self) -> dict[str, object]:
        message: dict[str, object] = {"id": self.message_id, "role": self.role, "parts": self.parts}
        if self.metadata is not None:
            message["metadata"] = self.metadata
        return message
