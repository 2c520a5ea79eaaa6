"""Fibers (one durable turn each) and the resumable stream buffer."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q


class FiberQuerySet(models.QuerySet["Fiber"]):
    def active(self) -> FiberQuerySet:
        return self.filter(status__in=[Fiber.Status.PENDING, Fiber.Status.RUNNING])


class Fiber(models.Model):
    """One turn, run by a Celery task under a lease; the fencing number orders its owners."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        COMPLETED = "completed"
        CANCELLED = "cancelled"
        FAILED = "failed"
        INTERRUPTED = "interrupted"

    class Kind(models.TextChoices):
        CHAT = "chat"
        CONTINUE = "continue"
        RETRY = "retry"
        PROGRAMMATIC = "programmatic"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    conversation = models.ForeignKey(
        "think_chat.Conversation", on_delete=models.CASCADE, related_name="fibers"
    )
    request_id = models.CharField(max_length=255)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.CHAT)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    snapshot = models.JSONField(null=True, blank=True)
    lease_owner = models.CharField(max_length=255, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    fencing = models.BigIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = FiberQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["conversation", "request_id"], name="think_fiber_request"),
        ]
        indexes = [
            models.Index(
                fields=["lease_expires_at"], name="think_fiber_running_lease", condition=Q(status="running")
            ),
            models.Index(fields=["conversation", "status"], name="think_fiber_conversation"),
        ]
        ordering = ["created_at"]

    def __str__(self) -> str:
        return f"fiber {self.request_id} ({self.status})"


class Stream(models.Model):
    """One streamed model response; its chunks live in segments."""

    class Status(models.TextChoices):
        STREAMING = "streaming"
        COMPLETED = "completed"
        ERROR = "error"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    conversation = models.ForeignKey(
        "think_chat.Conversation", on_delete=models.CASCADE, related_name="streams"
    )
    fiber = models.ForeignKey(Fiber, on_delete=models.SET_NULL, null=True, blank=True, related_name="streams")
    request_id = models.CharField(max_length=255)
    message_id = models.CharField(max_length=255)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.STREAMING)
    is_continuation = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["conversation", "status"], name="think_stream_status"),
            models.Index(fields=["conversation", "request_id"], name="think_stream_request"),
        ]
        ordering = ["created_at"]

    def __str__(self) -> str:
        return f"stream {self.request_id} ({self.status})"


class Segment(models.Model):
    """A batch of consecutive chunks of one stream.

    `body` holds the chunks' JSON texts joined by newlines: compact JSON never contains a raw newline,
    so chunks are stored and replayed without being decoded or re-encoded.
    """

    stream = models.ForeignKey(Stream, on_delete=models.CASCADE, related_name="segments")
    seq_start = models.IntegerField()
    seq_end = models.IntegerField()
    body = models.TextField()
    fencing = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["stream", "seq_start"], name="think_segment_seq"),
        ]
        ordering = ["stream", "seq_start"]

    def __str__(self) -> str:
        return f"segment {self.seq_start}-{self.seq_end}"

    def bodies(self) -> list[str]:
        return self.body.split("\n")
