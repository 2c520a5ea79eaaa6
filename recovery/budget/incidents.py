"""The recovery budget: config, the durable incident record and its pure evaluation.

A port of Think's `evaluateChatRecoveryIncident` and the pure decisions the recovery engine
takes around it. Nothing here touches Django, storage or the clock: the
engine reads the record and the progress counter, passes `now_ms` in, and persists what comes back. That
keeps the algorithm testable with an injected clock, which is the whole point of porting it exactly.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

DEFAULT_TERMINAL_MESSAGE = "The assistant was interrupted and could not recover. Please try again."
# Wake detections closer together than this are one storm and spend no attempt.
INCIDENT_DEBOUNCE_MS = 30_000
# An incident untouched for longer than this is a spent budget: the next detection opens a fresh one
# (and a live one is closed as expired). The record itself stays, as audit, until its retention ends.
INCIDENT_TTL_MS = 3_600_000
# Delay of the non-idempotent reschedule after a stable timeout (and after an OOM below budget).
STABLE_RETRY_DELAY_S = 3
# A "recovering" flag older than this is treated as absent.
RECOVERING_FLAG_TTL_MS = 900_000
# The wait before recovering a turn a provider failed transiently (a 5xx, a broken stream, a rate limit).
TRANSIENT_WAIT_MIN_S = 1.0
TRANSIENT_WAIT_MAX_S = 30.0
# A provider's Retry-After is honoured up to this; a longer one (a quota reset) is the budget's business.
RETRY_AFTER_MAX_S = 60.0

RECOVERY_KINDS = frozenset({"retry", "continue"})
INCIDENT_STATUSES = frozenset(
    {
        "detected",
        "scheduled",
        "attempting",
        "running",
        "completed",
        "skipped",
        "exhausted",
        "failed",
        "cancelled",
    }
)
# "running": the continuation (or retry) the recovery started is queued or streaming.
LIVE_STATUSES = frozenset({"detected", "scheduled", "attempting", "running"})

OUT_OF_MEMORY = "out_of_memory"
# The recovery's spend (the tokens or the cost of the attempts that were themselves interrupted) is over
# ChatRecovery.max_recovery_tokens or max_recovery_cost.
COST_BUDGET_EXCEEDED = "cost_budget_exceeded"
WORK_BUDGET_EXCEEDED = "work_budget_exceeded"
NO_PROGRESS_TIMEOUT = "no_progress_timeout"
RECOVERY_ABORTED = "recovery_aborted"
MAX_ATTEMPTS_EXCEEDED = "max_attempts_exceeded"
# Precedence order: when several bounds trip in one evaluation, the first one here is the reason.
EXHAUSTION_REASONS = (
    OUT_OF_MEMORY,
    COST_BUDGET_EXCEEDED,
    WORK_BUDGET_EXCEEDED,
    NO_PROGRESS_TIMEOUT,
    RECOVERY_ABORTED,
    MAX_ATTEMPTS_EXCEEDED,
)
# Give-up reasons of the recovery callbacks; they never come out of `evaluate_incident`.
STABLE_TIMEOUT = "stable_timeout"
RECOVERY_ERROR = "recovery_error"
# Reasons stored on a record that is rescheduled rather than exhausted.
STABLE_TIMEOUT_RETRY = "stable_timeout_retry"
OOM_RETRY = "oom_retry"

# Schedule reasons for `schedule_is_idempotent`.
SCHEDULE_INITIAL = "initial"
SCHEDULE_STABLE_TIMEOUT = "stable_timeout"
SCHEDULE_OOM = "oom"
SCHEDULE_TRANSIENT = "transient"


# --------------------------------------------------------------------------------------------------------
# Hook contexts
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProgressContext:
    """What `should_keep_recovering` sees: the attempt about to be spent and the work done so far."""

    incident_id: str
    request_id: str
    recovery_root_request_id: str
    attempt: int
    max_attempts: int
    recovery_kind: str
    work: int
    age_ms: int


@dataclass(frozen=True)
class ExhaustedContext:
    """What `on_exhausted` and the `chat:recovery:exhausted` event see at give-up."""

    incident_id: str
    request_id: str
    recovery_root_request_id: str
    attempt: int
    max_attempts: int
    recovery_kind: str
    stream_id: str
    created_at: int
    partial_text: str
    partial_parts: list[dict[str, Any]]
    reason: str
    terminal_message: str


# --------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRecovery:
    """The agent-facing recovery config.

    Unlike Cloudflare Think, which floors and clamps, invalid values raise ValueError here: bad input is
    rejected, never silently changed. A float with an integral value (6.0, as settings or JSON may produce)
    is accepted and stored as an int; 6.5 is rejected because flooring it would be such a silent change.
    """

    max_attempts: int = 10
    stable_timeout_ms: int = 10_000
    no_progress_timeout_ms: int = 300_000
    max_recovery_work: float = 1000
    max_oom_retries: int = 3
    # What the recovery may spend, counted over the attempts that were themselves interrupted (the turn
    # that was first interrupted is not the recovery's): tokens (input + output), and a cost in the
    # currency of the model's prices (litellm's cost map, or the agent's own). None: no bound.
    max_recovery_tokens: int | None = None
    max_recovery_cost: Decimal | None = None
    terminal_message: str = DEFAULT_TERMINAL_MESSAGE
    # Called as a plain function (never bound to the agent), only from the second attempt on.
    should_keep_recovering: Callable[[ProgressContext], bool] | None = None
    # May be sync or async; the engine awaits the result when it is awaitable.
    on_exhausted: Callable[[ExhaustedContext], Any] | None = None

    def __post_init__(self) -> None:
        # Frozen, so normalised values (6.0 -> 6) are written with object.__setattr__.
        for name, minimum in (
            ("max_attempts", 1),
            ("stable_timeout_ms", 0),
            ("no_progress_timeout_ms", 0),
            ("max_oom_retries", 0),
        ):
            object.__setattr__(self, name, _checked_int(name, getattr(self, name), minimum=minimum))
        object.__setattr__(self, "max_recovery_work", _checked_work(self.max_recovery_work))
        if self.max_recovery_tokens is not None:
            tokens = _checked_int("max_recovery_tokens", self.max_recovery_tokens, minimum=1)
            object.__setattr__(self, "max_recovery_tokens", tokens)
        object.__setattr__(self, "max_recovery_cost", _checked_cost(self.max_recovery_cost))
        _check_terminal_message(self.terminal_message)
        _check_predicate(self.should_keep_recovering)
        _check_on_exhausted(self.on_exhausted)


def _invalid(name: str, accepted: str, value: object) -> ValueError:
    return ValueError(f"ChatRecovery.{name} must be {accepted}; got {value!r}")


def _checked_int(name: str, value: object, *, minimum: int) -> int:
    accepted = f"an int >= {minimum}"
    # bool is an int subclass, but True as an attempt count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(name, accepted, value)
    if isinstance(value, float):
        if not value.is_integer():  # also rejects NaN and +-inf
            raise _invalid(name, accepted, value)
        value = int(value)
    if value < minimum:
        raise _invalid(name, accepted, value)
    return value


def _checked_work(value: object) -> float:
    # math.inf is the documented way to switch the work budget off; every other value is a count.
    if isinstance(value, float) and value == math.inf:
        return value
    try:
        return _checked_int("max_recovery_work", value, minimum=0)
    except ValueError:
        raise _invalid("max_recovery_work", "an int >= 0 or math.inf", value) from None


def _checked_cost(value: object) -> Decimal | None:
    """A Decimal (or an int) above zero, or None. A float is refused: 0.1 is not a price one can bill."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Decimal | int):
        raise _invalid("max_recovery_cost", "a Decimal above 0 (Decimal('0.50'), not a float) or None", value)
    cost = Decimal(value)
    if not cost.is_finite() or cost <= 0:
        raise _invalid("max_recovery_cost", "a Decimal above 0 or None", value)
    return cost


def _check_terminal_message(value: object) -> None:
    # A blank banner would leave the user with an error frame that says nothing.
    if not isinstance(value, str) or not value.strip():
        raise _invalid("terminal_message", "a non-empty string", value)


def _check_predicate(value: object) -> None:
    if value is not None and not callable(value):
        raise _invalid("should_keep_recovering", "a callable or None", value)
    # The evaluation is synchronous: a coroutine would be truthy and silently mean "keep going" forever.
    if inspect.iscoroutinefunction(value):
        raise _invalid("should_keep_recovering", "a synchronous callable (not async def) or None", value)


def _check_on_exhausted(value: object) -> None:
    if value is not None and not callable(value):
        raise _invalid("on_exhausted", "a callable (sync or async) or None", value)


def resolve_chat_recovery(raw: ChatRecovery | bool | None) -> ChatRecovery:
    """The effective config. Recovery cannot be turned off: True, legacy False and None give the defaults."""
    if isinstance(raw, ChatRecovery):
        return raw
    if raw is None or isinstance(raw, bool):
        return ChatRecovery()
    raise ValueError(f"chat_recovery must be a ChatRecovery, True, False or None; got {raw!r}")


# --------------------------------------------------------------------------------------------------------
# The durable record
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Incident:
    """One interrupted turn's recovery budget; times are epoch milliseconds."""

    incident_id: str
    request_id: str
    recovery_root_request_id: str
    recovery_kind: str
    attempt: int
    max_attempts: int
    status: str
    first_seen_at: int
    last_attempt_at: int
    last_progress_at: int | None = None
    reason: str | None = None
    progress: int | None = None
    work_baseline: int | None = None
    oom_attempts: int = 0
    # What the recovery's interrupted attempts spent (ChatRecovery.max_recovery_tokens, max_recovery_cost).
    spent_tokens: int = 0
    spent_cost: Decimal | None = None


@dataclass(frozen=True)
class Spend:
    """What one run of a turn spent on its model, by its completed steps: tokens and cost (None: not
    priced)."""

    tokens: int = 0
    cost: Decimal | None = None

    def __add__(self, other: Spend) -> Spend:
        cost = None if self.cost is None and other.cost is None else (self.cost or 0) + (other.cost or 0)
        return Spend(self.tokens + other.tokens, Decimal(cost) if cost is not None else None)


def incident_id_for(
    *, request_id: str, recovery_root_request_id: str | None, latest_user_message_id: str | None
) -> str:
    """The budget key. The kind is left out so a turn flipping between retry and continue keeps one budget."""
    root = recovery_root_request_id if recovery_root_request_id is not None else request_id
    user = latest_user_message_id if latest_user_message_id is not None else ""
    return f"{root}:{user}"


def is_stale(incident: Incident, *, now_ms: int) -> bool:
    """True when the record has not been evaluated or rescheduled for more than INCIDENT_TTL_MS."""
    return now_ms - incident.last_attempt_at > INCIDENT_TTL_MS


def stale_ids(incidents: Iterable[Incident], *, now_ms: int) -> list[str]:
    return [incident.incident_id for incident in incidents if is_stale(incident, now_ms=now_ms)]


def live_incidents(incidents: Iterable[Incident]) -> list[Incident]:
    return [incident for incident in incidents if incident.status in LIVE_STATUSES]


def effective_max_attempts(incident: Incident, config: ChatRecovery) -> int:
    """The record's cap, or the config's when the record has none (stored as 0, since valid caps are >= 1)."""
    return incident.max_attempts if incident.max_attempts >= 1 else config.max_attempts


# --------------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation:
    """The outcome of one detection: the record to persist and whether the budget is spent."""

    incident: Incident
    exhausted: bool
    reason: str | None
    opened: bool
    predicate_error: BaseException | None = None


@dataclass(frozen=True)
class _Measurement:
    """The budget arithmetic of one detection, before the caller's predicate has a say."""

    last_progress_at: int
    progress: int
    work_baseline: int
    attempt: int
    oom_attempts: int
    tripped: frozenset[str]  # the hard bounds (and max_attempts_exceeded) that fired

    @property
    def work(self) -> int:
        return self.progress - self.work_baseline


def evaluate_incident(
    *,
    existing: Incident | None,
    incident_id: str,
    request_id: str,
    recovery_root_request_id: str,
    recovery_kind: str,
    progress: int,
    config: ChatRecovery,
    now_ms: int,
    awaiting: bool,
    spent: Spend | None = None,
) -> Evaluation:
    """Open or re-evaluate an incident on a detection.

    `progress` is the durable progress counter now; `awaiting` is true while a client interaction is pending;
    `spent` is what the interrupted run spent, counted when it was a recovery's attempt (an existing
    incident), never for the turn that opened it.
    """
    measured = _measure(existing, progress=progress, config=config, now_ms=now_ms, awaiting=awaiting)
    total = Spend(existing.spent_tokens, existing.spent_cost) if existing is not None else Spend()
    if existing is not None and spent is not None:
        total = total + spent
    over_budget = existing is not None and _over_budget(total, config)
    if over_budget:
        measured = replace(measured, tripped=measured.tripped | {COST_BUDGET_EXCEEDED})
    draft = Incident(
        incident_id=incident_id,
        request_id=request_id,
        recovery_root_request_id=recovery_root_request_id,
        recovery_kind=recovery_kind,
        attempt=measured.attempt,
        max_attempts=config.max_attempts,
        status="attempting",
        first_seen_at=existing.first_seen_at if existing is not None else now_ms,
        last_attempt_at=now_ms,  # refreshed on every detection, so a storm never leaves the debounce window
        last_progress_at=measured.last_progress_at,
        progress=measured.progress,
        work_baseline=measured.work_baseline,
        oom_attempts=measured.oom_attempts,
        spent_tokens=total.tokens,
        spent_cost=total.cost,
    )
    aborted, predicate_error = False, None
    # The predicate is never asked on first detection, for a human-in-the-loop turn, or once a bound tripped.
    if existing is not None and not awaiting and not measured.tripped:
        aborted, predicate_error = _consult_predicate(config, _progress_context(draft, measured, now_ms))
    tripped = (measured.tripped | {RECOVERY_ABORTED}) if aborted else measured.tripped
    # A turn waiting on a human has no budget at all: nothing it tripped counts.
    reason = None if awaiting else first_exhaustion_reason(tripped)
    record = replace(draft, status="exhausted", reason=reason) if reason is not None else draft
    return Evaluation(
        incident=record,
        exhausted=reason is not None,
        reason=reason,
        opened=existing is None,
        predicate_error=predicate_error,
    )


def _progress_context(draft: Incident, measured: _Measurement, now_ms: int) -> ProgressContext:
    return ProgressContext(
        incident_id=draft.incident_id,
        request_id=draft.request_id,
        recovery_root_request_id=draft.recovery_root_request_id,
        attempt=draft.attempt,
        max_attempts=draft.max_attempts,
        recovery_kind=draft.recovery_kind,
        work=measured.work,
        age_ms=now_ms - draft.first_seen_at,
    )


def _measure(
    existing: Incident | None, *, progress: int, config: ChatRecovery, now_ms: int, awaiting: bool
) -> _Measurement:
    if existing is None:
        # Opening: the baseline is today's counter, so work only counts what happens after the interruption.
        return _Measurement(
            last_progress_at=now_ms,
            progress=max(0, progress),
            work_baseline=progress,
            attempt=1,
            oom_attempts=0,
            tripped=frozenset(),
        )
    previous = existing.progress if existing.progress is not None else 0
    made_progress = progress > previous
    measured = _Measurement(
        last_progress_at=now_ms if made_progress or awaiting else _last_progress_at(existing),
        progress=max(previous, progress),
        work_baseline=existing.work_baseline if existing.work_baseline is not None else progress,
        attempt=_next_attempt(existing, made_progress=made_progress, now_ms=now_ms),
        oom_attempts=existing.oom_attempts,
        tripped=frozenset(),
    )
    return replace(
        measured, tripped=_tripped_bounds(measured, config=config, now_ms=now_ms, awaiting=awaiting)
    )


def _last_progress_at(existing: Incident) -> int:
    # Records written before last_progress_at existed count from when the incident opened.
    return existing.last_progress_at if existing.last_progress_at is not None else existing.first_seen_at


def _next_attempt(existing: Incident, *, made_progress: bool, now_ms: int) -> int:
    # Progress means the last attempt was worth it: deploy churn during a healthy turn never runs out.
    if made_progress:
        return 1
    if now_ms - existing.last_attempt_at < INCIDENT_DEBOUNCE_MS:
        return existing.attempt
    # So the (max_attempts + 1)-th spaced-out detection without progress is the one that exhausts.
    return existing.attempt + 1


def _over_budget(total: Spend, config: ChatRecovery) -> bool:
    if config.max_recovery_tokens is not None and total.tokens > config.max_recovery_tokens:
        return True
    return (
        config.max_recovery_cost is not None
        and total.cost is not None
        and total.cost > config.max_recovery_cost
    )


def _tripped_bounds(
    measured: _Measurement, *, config: ChatRecovery, now_ms: int, awaiting: bool
) -> frozenset[str]:
    """Bounds that fire for an existing incident (never on first detection)."""
    tripped: set[str] = set()
    if not awaiting and now_ms - measured.last_progress_at > config.no_progress_timeout_ms:
        tripped.add(NO_PROGRESS_TIMEOUT)
    if math.isfinite(config.max_recovery_work) and measured.work > config.max_recovery_work:
        tripped.add(WORK_BUDGET_EXCEEDED)
    if not awaiting and measured.oom_attempts > config.max_oom_retries:
        tripped.add(OUT_OF_MEMORY)
    if measured.attempt > config.max_attempts:
        tripped.add(MAX_ATTEMPTS_EXCEEDED)
    return frozenset(tripped)


def _consult_predicate(config: ChatRecovery, context: ProgressContext) -> tuple[bool, BaseException | None]:
    """(aborted, error). A broken predicate must not seal a healthy turn, so an error means keep going."""
    predicate = config.should_keep_recovering
    if predicate is None:
        return False, None
    try:
        verdict: object = predicate(context)
    except Exception as error:  # only Exception: KeyboardInterrupt and friends must still propagate
        return False, error
    if inspect.isawaitable(verdict):
        # A sync callable that returned a coroutine: it cannot be awaited here, so it cannot decide.
        if inspect.iscoroutine(verdict):
            verdict.close()
        return False, TypeError("should_keep_recovering returned an awaitable; it must return a bool")
    return verdict is False, None


def first_exhaustion_reason(tripped: Collection[str]) -> str | None:
    """The reason to record when the given bounds tripped together, by EXHAUSTION_REASONS precedence."""
    return next((reason for reason in EXHAUSTION_REASONS if reason in tripped), None)


# --------------------------------------------------------------------------------------------------------
# Engine-side decisions
# --------------------------------------------------------------------------------------------------------


def schedule_is_idempotent(reason: str) -> bool:
    """Whether a recovery schedule deduplicates.

    The initial schedule does, so repeated wake detections collapse into one queued callback. A reschedule
    from inside a running one-shot must not: the running row is deleted after the callback returns, so
    deduplicating against it would drop the reschedule.
    """
    if reason == SCHEDULE_INITIAL:
        return True
    # A transient failure is handed over by the failing turn itself, which a recovery alarm may have
    # started: that alarm's row is still there (running) and must not swallow the new schedule.
    if reason in (SCHEDULE_STABLE_TIMEOUT, SCHEDULE_OOM, SCHEDULE_TRANSIENT):
        return False
    raise ValueError(
        f"unknown schedule reason {reason!r}; expected 'initial', 'stable_timeout', 'oom' or 'transient'"
    )


def transient_wait_s(incident: Incident, *, now_ms: int, retry_after_s: float | None = None) -> float:
    """How long to wait before recovering a turn that a provider failed transiently.

    As long again as the turn has gone without progress, so back-to-back failures wait 1, 2, 4, ... s,
    from TRANSIENT_WAIT_MIN_S up to TRANSIENT_WAIT_MAX_S; progress starts again from the minimum. A
    Retry-After the provider sent makes it at least that, up to RETRY_AFTER_MAX_S. The budget still
    decides whether there is a next attempt at all.
    """
    without_progress_s = max(0, now_ms - _last_progress_at(incident)) / 1000
    wait = min(max(without_progress_s, TRANSIENT_WAIT_MIN_S), TRANSIENT_WAIT_MAX_S)
    if retry_after_s is not None and math.isfinite(retry_after_s) and retry_after_s > 0:
        wait = max(wait, min(retry_after_s, RETRY_AFTER_MAX_S))
    return wait


def reschedule_after_stable_timeout(
    incident: Incident | None, *, config: ChatRecovery, now_ms: int
) -> Incident | None:
    """The record for a 3 s retry after the turn did not settle, or None when the caller must give up.

    Waiting for stability counts as an attempt, otherwise a conversation that never settles would be
    rescheduled forever. The predicate is deliberately not consulted on this path.
    """
    if incident is None or incident.attempt >= effective_max_attempts(incident, config):
        return None
    return replace(
        incident,
        attempt=incident.attempt + 1,
        status="scheduled",
        reason=STABLE_TIMEOUT_RETRY,
        last_attempt_at=now_ms,
    )


def record_oom_and_decide(
    incident: Incident | None, *, config: ChatRecovery, now_ms: int
) -> tuple[Incident | None, bool]:
    """Count an attempt that died of memory exhaustion; returns (record to persist, exhausted).

    OOM has its own budget because re-running an OOM-ing turn streams a little progress that would reset
    the attempt cap forever, so `attempt` is left alone. Below budget the record is rescheduled
    (`oom_retry`). Over budget the bumped count and reason `out_of_memory` are kept (so a later begin-path
    evaluation agrees) but the status is not sealed: the give-up spine skips records already marked
    exhausted, and sealing here would swallow the terminal banner. A missing record cannot carry a count,
    so it is exhausted rather than risking an endless OOM loop.
    """
    if incident is None:
        return None, True
    bumped = replace(incident, oom_attempts=incident.oom_attempts + 1, last_attempt_at=now_ms)
    if bumped.oom_attempts > config.max_oom_retries:
        return replace(bumped, reason=OUT_OF_MEMORY), True
    return replace(bumped, status="scheduled", reason=OOM_RETRY), False


def exhausted_context(
    incident: Incident,
    *,
    config: ChatRecovery,
    stream_id: str,
    created_at: int,
    partial_text: str,
    partial_parts: list[dict[str, Any]],
) -> ExhaustedContext:
    """The give-up context; an empty root or a missing reason fall back like the reference's `??`."""
    return ExhaustedContext(
        incident_id=incident.incident_id,
        request_id=incident.request_id,
        recovery_root_request_id=incident.recovery_root_request_id or incident.request_id,
        attempt=incident.attempt,
        max_attempts=effective_max_attempts(incident, config),
        recovery_kind=incident.recovery_kind,
        stream_id=stream_id,
        created_at=created_at,
        partial_text=partial_text,
        partial_parts=list(partial_parts),  # a copy, so a hook mutating it cannot touch the caller's parts
        reason=incident.reason or MAX_ATTEMPTS_EXCEEDED,
        terminal_message=config.terminal_message,
    )
