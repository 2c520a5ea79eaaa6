"""The recovery target: what the app that owns the fibers tells the recovery layer about its work.

The recovery layer stores fibers, streams, incidents and alarms and runs the engine's spine
(detection -> budget -> hook -> dispatch -> give-up, recovery.engine.spine); what a fiber *is* (a chat turn),
how its interrupted state is read, what the agent's hook answers, how a continuation is started and how
clients hear of the outcome belong to the app that owns it. That app subclasses `RecoveryTarget` and
registers one instance in its AppConfig.ready(), the way an app registers a ModelAdmin; the chat app
registers chat.turn.interrupted.ChatTarget.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from recovery.budget.incidents import ChatRecovery, Incident
    from recovery.engine.context import ChatRecoveryOptions
    from recovery.lease.fibers import FiberId
    from recovery.models import Incident as IncidentRow


class Interrupted(Protocol):
    """An interrupted fiber as its owner loaded it: what the engine's spine reads (the owner keeps the
    rest)."""

    @property
    def fiber_id(self) -> FiberId: ...
    @property
    def owner_id(self) -> int: ...  # the row that owns the fiber (recovery.models.owner_model)
    @property
    def request_id(self) -> str: ...
    @property
    def root_request_id(self) -> str: ...  # the first request of a chain of continuations
    @property
    def latest_user_message_id(self) -> str | None: ...
    @property
    def kind(self) -> str: ...  # "continue" or "retry"
    @property
    def interruption(self) -> str: ...  # the reason recorded on the fiber ("worker_lost", "stall", ...)
    @property
    def config(self) -> ChatRecovery: ...  # the owner's budget and hooks
    @property
    def stream_id(self) -> str: ...
    @property
    def created_at_ms(self) -> int: ...
    @property
    def partial_text(self) -> str: ...
    @property
    def partial_parts(self) -> list[dict[str, Any]]: ...
    @property
    def trace(
        self,
    ) -> Any: ...  # the trace context its run recorded (recovery.lease.fibers.TRACE_SLOT), or None

    def emit(self, event_type: str, payload: dict[str, Any]) -> None:
        """A diagnostics event, labelled with the owner's names."""


class RecoveryTarget(ABC):
    """The owner's side of recovery. Async methods run on the worker's event loop (database work goes
    through recovery.process.runtime.db); sync ones are operator actions, called from the admin or a
    command."""

    #: The Celery task that runs the fibers: the tick reads the length of its queue.
    task_name: str
    #: The fiber name diagnostics events carry, formatted with the request id.
    fiber_name: str = "{request_id}"

    # -- dispatch ----------------------------------------------------------------------------------------

    @abstractmethod
    def enqueue_next(self, owner_id: int) -> None:
        """Send the head pending fiber of an owner (again): a worker died after taking it, before claiming."""

    # -- the engine's steps ------------------------------------------------------------------------------

    @abstractmethod
    async def load(self, fiber_id: FiberId) -> Interrupted | None:
        """The interrupted fiber with what the owner needs to recover it; None if it is not interrupted."""

    @abstractmethod
    async def awaiting(self, work: Interrupted) -> bool:
        """Whether a human is pending (an approval, a client tool): such a wait costs no budget."""

    @abstractmethod
    async def hook(self, work: Interrupted, incident: Incident) -> ChatRecoveryOptions | None:
        """The owner's recovery hook: continue or not, keep the partial or not. An exception fails the
        incident and leaves the fiber for a later tick."""

    @abstractmethod
    async def persist(self, work: Interrupted, *, keep: bool) -> None:
        """Settle what the dead fiber left open (its partial stored when `keep`)."""

    @abstractmethod
    async def dispatch(
        self, work: Interrupted, incident: Incident, options: ChatRecoveryOptions, *, delay_s: float
    ) -> None:
        """Start the recovery the options ask for, `delay_s` from now (recovery.engine.spine.schedule), or
        skip it (spine.skip)."""

    @abstractmethod
    async def end(self, work: Interrupted, *, request_id: str, message: str) -> None:
        """Recovery gave up: store `message` as the terminal outcome of `request_id`, tell the clients."""

    @abstractmethod
    async def set_recovering(self, owner_id: int, request_id: str | None) -> None:
        """Recovery of `request_id` starts (None: it is over); clients hear of a real change only."""

    # -- operator actions --------------------------------------------------------------------------------

    @abstractmethod
    def give_up(self, incident: IncidentRow, *, reason: str) -> None:
        """Give up on an open incident now: nothing of it resumes later, the terminal outcome goes out."""

    @abstractmethod
    def clear_recovering(self, owner_id: int) -> bool:
        """Clear a stuck recovering flag and tell the clients; False when there was none."""

    @abstractmethod
    def owner_pk(self, *, agent: str, name: str) -> int | None:
        """The owner row a command names as AGENT/NAME; None when there is none."""

    def labels(self, owner: Any) -> dict[str, str]:
        """The names diagnostics events about an owner row carry (`agent`, `name`)."""
        return {}


_target: RecoveryTarget | None = None


def register_target(target: RecoveryTarget) -> None:
    global _target
    _target = target


def owner_labels(owner: Any) -> dict[str, str]:
    """The registered target's labels of an owner row; none while no target is registered."""
    return {} if _target is None else _target.labels(owner)


def recovery_target() -> RecoveryTarget:
    if _target is None:
        raise ImproperlyConfigured("no app registered a recovery target (is the chat app installed?)")
    return _target
