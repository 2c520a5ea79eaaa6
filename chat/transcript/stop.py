"""Stopping a whole conversation, durably, in one transaction.

`conversation_stop` aborts the running turn (its stored partial becomes its message, settled), cancels
every queued turn and open submission, settles every tool call still waiting for a human or a client
(approvals, client tools) as cancelled, closes the open recovery incidents and deletes their alarms.
Once it commits, nothing of the old work resumes: the stopped worker's writes are fenced, the engine
loads none of its fibers, an alarm that was already firing finds its incident cancelled, and the next
message runs as new work. chat.turn.actions tells the clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import Q

from recovery.engine.alarms import alarms_cancel
from recovery.engine.store import incidents_cancel
from recovery.lease.fibers import StoppedFiber, fibers_stop
from recovery.models import Fiber, Stream
from recovery.stream.buffer import stream_close

from ..models import Message, Submission
from ..types import Part
from .completions import Ending, completion_record, root_of
from .interactions import foreign_updates_apply
from .repair import is_repairable, is_settled
from .selectors import stream_partial
from .services import conversation_lock, message_place
from .snapshot import FiberSnapshot
from .submissions import DRAIN_CALLBACK, submission_set_status
from .turns import CONTINUE_CALLBACK, RETRY_CALLBACK

# The reason recorded on what a stop closed (incidents, submissions).
STOPPED = "stopped"
STOPPED_TOOL_ERROR = "Cancelled: the conversation was stopped before this tool call finished."
STOPPED_SUBMISSION = "The conversation was stopped."

# The tool states a stop settles: nothing will ever answer them.
_WAITING_STATES = ("input-streaming", "input-available", "approval-requested", "approval-responded")


@dataclass(frozen=True)
class StoppedStream:
    """A turn stopped mid-stream: its clients' stream ends at `seq` (after its last stored chunk)."""

    request_id: str
    seq: int
    continuation: bool


@dataclass(frozen=True)
class StopReport:
    """What a stop ended; empty when the conversation was idle."""

    streams: tuple[StoppedStream, ...] = ()
    queued: tuple[str, ...] = ()  # request ids of turns cancelled before they streamed
    submissions: tuple[str, ...] = ()
    tool_calls: tuple[str, ...] = ()  # call ids settled as cancelled
    incidents: tuple[str, ...] = ()
    recovering: bool = False  # the conversation showed "recovering"

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.streams] + list(self.queued)

    @property
    def stopped_anything(self) -> bool:
        return bool(self.streams or self.queued or self.submissions or self.tool_calls or self.incidents)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requestIds": self.request_ids,
            "submissions": list(self.submissions),
            "toolCalls": list(self.tool_calls),
            "incidents": list(self.incidents),
        }


def settle_cancelled(parts: list[Part], settled: list[str]) -> list[Part]:
    """The parts with every tool call still waiting marked as cancelled (`output-error`, a valid result
    for the model); the call ids it settled are added to `settled`."""
    out = []
    for part in parts:
        if is_repairable(part) and not is_settled(part):
            settled.append(str(part["toolCallId"]))
            part = {**part, "state": "output-error", "errorText": STOPPED_TOOL_ERROR}
        out.append(part)
    return out


def _settle_stream(
    conversation_id: int, fiber: StoppedFiber, settled: list[str]
) -> tuple[StoppedStream, str | None] | None:
    """Store what a running or interrupted fiber streamed as its message (settled) and close its stream."""
    stream = (
        Stream.objects.filter(fiber_id=fiber.fiber_id, status=Stream.Status.STREAMING)
        .order_by("-created_at")
        .first()
    )
    if stream is None:
        return None
    partial, last_seq = stream_partial(stream)
    answer = None
    if partial.has_content:
        partial.close_open_parts()
        message = partial.message()
        message["parts"] = settle_cancelled(message["parts"], settled)
        turn = FiberSnapshot.from_json(fiber.snapshot).turn
        after = turn.latest_message_id if turn is not None else None
        message_place(conversation_id=conversation_id, message=message, after_message_id=after)
        answer = message["id"]
    # Results of approved tools the turn ran belong to earlier messages: true, and kept.
    foreign_updates_apply(conversation_id=conversation_id, updates=partial.foreign_tool_updates)
    stream_close(stream_id=stream.pk, status=Stream.Status.COMPLETED)
    return StoppedStream(stream.request_id, last_seq + 1, stream.is_continuation), answer


def _settle_waiting_tools(conversation_id: int, settled: list[str]) -> None:
    waiting = Q()
    for state in _WAITING_STATES:
        waiting |= Q(parts__contains=[{"state": state}])
    for message in Message.objects.filter(
        conversation_id=conversation_id, role=Message.Role.ASSISTANT
    ).filter(waiting):
        parts = settle_cancelled(message.parts, settled)
        if parts != message.parts:
            message.parts = parts
            message.save(update_fields=["parts", "updated_at"])


def conversation_stop(*, conversation_id: int) -> StopReport:
    """Stop everything of a conversation in one transaction (see the module docstring)."""
    with transaction.atomic():
        conversation = conversation_lock(conversation_id)
        fibers = fibers_stop(conversation_id=conversation_id)
        settled: list[str] = []
        streams: list[StoppedStream] = []
        queued: list[str] = []
        for fiber in fibers:
            stopped = (
                None
                if fiber.status == Fiber.Status.PENDING
                else _settle_stream(conversation_id, fiber, settled)
            )
            if stopped is not None:
                streams.append(stopped[0])
            elif fiber.status != Fiber.Status.INTERRUPTED:  # its sender still waits for an answer
                queued.append(fiber.request_id)
            completion_record(
                conversation_id=conversation_id,
                request_id=root_of(fiber.request_id, fiber.snapshot),
                last_request_id=fiber.request_id,
                ending=Ending.CANCELLED,
                message_id=stopped[1] if stopped is not None else None,
            )
        _settle_waiting_tools(conversation_id, settled)
        submissions = []
        for pk, submission_id in (
            Submission.objects.filter(conversation_id=conversation_id)
            .open()
            .values_list("pk", "submission_id")
        ):
            if submission_set_status(pk, Submission.Status.ABORTED, STOPPED_SUBMISSION):
                submissions.append(submission_id)
        incidents = incidents_cancel(conversation_id=conversation_id, reason=STOPPED)
        for incident in incidents:  # a turn between its interruption and its continuation ends here too
            completion_record(
                conversation_id=conversation_id,
                request_id=incident.recovery_root_request_id,
                last_request_id=incident.request_id,
                ending=Ending.CANCELLED,
            )
        alarms_cancel(
            conversation_id=conversation_id, callbacks=[CONTINUE_CALLBACK, RETRY_CALLBACK, DRAIN_CALLBACK]
        )
        recovering = conversation.recovering is not None
        conversation.tool_updates = []  # answers buffered for the stopped turn: nothing will apply them
        conversation.continue_armed = ""
        conversation.recovering = None
        conversation.save(update_fields=["tool_updates", "continue_armed", "recovering", "updated_at"])
    return StopReport(
        streams=tuple(streams),
        queued=tuple(queued),
        submissions=tuple(submissions),
        tool_calls=tuple(dict.fromkeys(settled)),
        incidents=tuple(i.incident_id for i in incidents),
        recovering=recovering,
    )
