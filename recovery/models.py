"""Fibers (one durable turn each) and the resumable stream buffer."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q

from recovery.conf import owner_model_label

# Every row of the layer belongs to an owner row (a conversation), named by settings.THINK_OWNER_MODEL:
# the layer reaches it through these relations and never imports the app that defines it.
OWNER_MODEL = owner_model_label()


# The statuses of a fiber that holds its conversation.
ACTIVE_STATUSES = ("pending", "running")


class FiberQuerySet(models.QuerySet["Fiber"]):
    def active(self) -> FiberQuerySet:
        """Queued or running: what makes a conversation busy (recovery.lease.fibers.conversation_busy)."""
        return self.filter(status__in=ACTIVE_STATUSES)


class Fiber(models.Model):
    """One turn, run by a Celery task under a lease; the fencing number orders its owners."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        COMPLETED = "completed"
        CANCELLED = "cancelled"
        FAILED = "failed"
        # The lease expired (or the turn stalled or its worker shut down): the engine owns it now.
        INTERRUPTED = "interrupted"
        # The engine has handled the interruption (scheduled a continuation, gave up, or skipped).
        RECOVERED = "recovered"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    conversation = models.ForeignKey(OWNER_MODEL, on_delete=models.CASCADE, related_name="fibers")
    request_id = models.CharField(max_length=255)
    # What kind of work the owning app runs in it (the chat app's TurnKind); the layer never reads it.
    kind = models.CharField(max_length=16)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    snapshot = models.JSONField(null=True, blank=True)
    lease_owner = models.CharField(max_length=255, blank=True, default="")
    # The liveness key of the process that holds the lease (recovery.lease.liveness); None: lease only.
    lease_session = models.BigIntegerField(null=True, blank=True)
    # When a poll last found that key's session gone (a later poll confirms it before taking over).
    lease_lost_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    fencing = models.BigIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    # Why the turn stopped, when its worker knew: "worker_lost" (a pool child killed, e.g. by the
    # OOM killer), "out_of_memory", "stalled" or "shutdown". Empty for a silent death.
    interruption = models.CharField(max_length=32, blank=True, default="")
    error = models.TextField(blank=True, default="")
    # What the run spent on its model, by its completed steps (the owner records them, fenced:
    # recovery.lease.fibers.fiber_spend_add); cost in the currency of the prices used, None when unpriced.
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    cost = models.DecimalField(max_digits=24, decimal_places=12, null=True, blank=True)
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
    conversation = models.ForeignKey(OWNER_MODEL, on_delete=models.CASCADE, related_name="streams")
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


class Incident(models.Model):
    """A recovery incident: the budget of one interrupted turn and its continuations.

    Times are epoch milliseconds, as in the pure budget function that evaluates them.
    """

    class Status(models.TextChoices):
        DETECTED = "detected"
        SCHEDULED = "scheduled"
        ATTEMPTING = "attempting"
        RUNNING = "running"  # the recovery's continuation or retry is queued or streaming
        COMPLETED = "completed"
        SKIPPED = "skipped"
        EXHAUSTED = "exhausted"
        FAILED = "failed"
        # Closed by a stop of the whole conversation (chat.turn.actions): nothing of it may resume, and no
        # later write of the engine reopens it (recovery.engine.store).
        CANCELLED = "cancelled"

    conversation = models.ForeignKey(OWNER_MODEL, on_delete=models.CASCADE, related_name="incidents")
    incident_id = models.CharField(max_length=600)
    request_id = models.CharField(max_length=255)
    recovery_root_request_id = models.CharField(max_length=255)
    recovery_kind = models.CharField(max_length=16)
    attempt = models.IntegerField(default=1)
    max_attempts = models.IntegerField()
    status = models.CharField(max_length=16, choices=Status.choices)
    first_seen_at = models.BigIntegerField()
    last_attempt_at = models.BigIntegerField()
    last_progress_at = models.BigIntegerField(null=True, blank=True)
    reason = models.CharField(max_length=64, blank=True, default="")
    progress = models.BigIntegerField(null=True, blank=True)
    work_baseline = models.BigIntegerField(null=True, blank=True)
    oom_attempts = models.IntegerField(default=0)
    # What the recovery's interrupted attempts spent (ChatRecovery.max_recovery_tokens, max_recovery_cost).
    spent_tokens = models.BigIntegerField(default=0)
    spent_cost = models.DecimalField(max_digits=24, decimal_places=12, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["conversation", "incident_id"], name="think_incident_id"),
        ]
        indexes = [models.Index(fields=["status"], name="think_incident_status")]
        ordering = ["-updated_at"]

    def __str__(self) -> str:
        return f"incident {self.incident_id} ({self.status})"


class Alarm(models.Model):
    """A durable one-shot callback, fired by the beat tick when due (never a Celery ETA task).

    Idempotent schedules carry a key, so repeated detections collapse into one pending alarm;
    reschedules made from inside a running alarm have none and always add a row.
    """

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"

    conversation = models.ForeignKey(OWNER_MODEL, on_delete=models.CASCADE, related_name="alarms")
    callback = models.CharField(max_length=64)
    payload = models.JSONField(default=dict)
    due_at = models.DateTimeField()
    idempotency_key = models.CharField(max_length=128, null=True, blank=True, unique=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.IntegerField(default=0)
    claimed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["due_at"], name="think_alarm_due", condition=Q(status="pending"))]
        ordering = ["due_at"]

    def __str__(self) -> str:
        return f"alarm {self.callback} at {self.due_at:%H:%M:%S}"


def owner_model() -> type[models.Model]:
    """The model whose rows own fibers, streams and incidents (settings.THINK_OWNER_MODEL), reached
    through the fibers' relation: the recovery layer never imports it."""
    return Fiber._meta.get_field("conversation").related_model  # type: ignore[return-value]


class Fault(models.Model):
    """An unexpected error of a model provider, a tool or a turn, kept for operators.

    Clients only ever see a generic text naming the first 8 hex digits of the id ("error 3f2a9c1e"); the
    class, the full text and the traceback are here and in the log line that carries the same id.
    """

    class Kind(models.TextChoices):
        PROVIDER = "provider"
        TOOL = "tool"
        TURN = "turn"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    conversation = models.ForeignKey(
        OWNER_MODEL, on_delete=models.CASCADE, null=True, blank=True, related_name="faults"
    )
    fiber_id = models.UUIDField(null=True, blank=True)  # not a key: the fault outlives a swept fiber
    request_id = models.CharField(max_length=255, blank=True, default="")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    error_class = models.CharField(max_length=255)
    text = models.TextField(blank=True, default="")
    traceback = models.TextField(blank=True, default="")

    class Meta:
        indexes = [models.Index(fields=["created_at"], name="think_fault_created")]
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.kind} fault {self.reference} ({self.error_class})"

    @property
    def reference(self) -> str:
        """What clients are shown of the id."""
        return fault_reference(self.id)


def fault_reference(fault_id: uuid.UUID) -> str:
    """The short form of a fault's id that public error texts carry."""
    return fault_id.hex[:8]
