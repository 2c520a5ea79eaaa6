"""The pure recovery budget and the engine's pure decisions, with an injected clock.

Test names follow the cases of the anchor's own suites (`recovery-incident.test.ts`,
`recovery-engine.test.ts` in cloudflare/agents) so a reader can match them; no database, no Django,
no real time.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest

from recovery.budget.incidents import (
    DEFAULT_TERMINAL_MESSAGE,
    EXHAUSTION_REASONS,
    INCIDENT_DEBOUNCE_MS,
    INCIDENT_TTL_MS,
    LIVE_STATUSES,
    RECOVERING_FLAG_TTL_MS,
    RETRY_AFTER_MAX_S,
    STABLE_RETRY_DELAY_S,
    TRANSIENT_WAIT_MAX_S,
    TRANSIENT_WAIT_MIN_S,
    ChatRecovery,
    Evaluation,
    ExhaustedContext,
    Incident,
    ProgressContext,
    Spend,
    evaluate_incident,
    exhausted_context,
    first_exhaustion_reason,
    incident_id_for,
    is_stale,
    live_incidents,
    record_oom_and_decide,
    reschedule_after_stable_timeout,
    resolve_chat_recovery,
    schedule_is_idempotent,
    stale_ids,
    transient_wait_s,
)

T0 = 1_700_000_000_000
NO_PROGRESS_MS = 300_000
PAST_DEBOUNCE = INCIDENT_DEBOUNCE_MS + 1


def evaluate(
    *,
    existing: Incident | None = None,
    config: ChatRecovery | None = None,
    progress: int = 0,
    now_ms: int = T0,
    awaiting: bool = False,
    recovery_kind: str = "continue",
    request_id: str = "req-1",
) -> Evaluation:
    return evaluate_incident(
        existing=existing,
        incident_id="root-1:user-1",
        request_id=request_id,
        recovery_root_request_id="root-1",
        recovery_kind=recovery_kind,
        progress=progress,
        config=config or ChatRecovery(),
        now_ms=now_ms,
        awaiting=awaiting,
    )


def opened(**changes: Any) -> Incident:
    """The record a first detection at T0 with progress 0 writes, with `changes` applied."""
    return replace(evaluate().incident, **changes)


def incident(**changes: Any) -> Incident:
    base = Incident(
        incident_id="root-1:user-1",
        request_id="req-1",
        recovery_root_request_id="root-1",
        recovery_kind="continue",
        attempt=1,
        max_attempts=6,
        status="attempting",
        first_seen_at=1_000,
        last_attempt_at=1_000,
    )
    return replace(base, **changes)


class Recorder:
    """A predicate that records its calls and answers with a fixed verdict."""

    def __init__(self, verdict: bool) -> None:
        self.verdict = verdict
        self.calls: list[ProgressContext] = []

    def __call__(self, ctx: ProgressContext) -> bool:
        self.calls.append(ctx)
        return self.verdict


# --------------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------------


def test_hard_coded_constants_match_the_reference() -> None:
    assert INCIDENT_DEBOUNCE_MS == 30_000
    assert INCIDENT_TTL_MS == 3_600_000
    assert STABLE_RETRY_DELAY_S == 3
    assert RECOVERING_FLAG_TTL_MS == 900_000
    assert LIVE_STATUSES == {"detected", "scheduled", "attempting", "running"}
    assert EXHAUSTION_REASONS == (
        "out_of_memory",
        "cost_budget_exceeded",
        "work_budget_exceeded",
        "no_progress_timeout",
        "recovery_aborted",
        "max_attempts_exceeded",
    )


# --------------------------------------------------------------------------------------------------------
# Incident id
# --------------------------------------------------------------------------------------------------------


def test_incident_id_joins_root_and_latest_user_id_without_kind() -> None:
    # The function takes no kind at all: a retry and a continue of one turn cannot get different ids.
    assert (
        incident_id_for(
            request_id="req-1", recovery_root_request_id="root-1", latest_user_message_id="user-1"
        )
        == "root-1:user-1"
    )


def test_incident_id_falls_back_to_request_id() -> None:
    assert (
        incident_id_for(request_id="req-2", recovery_root_request_id=None, latest_user_message_id="user-2")
        == "req-2:user-2"
    )


def test_incident_id_tolerates_missing_user_id() -> None:
    assert incident_id_for(
        request_id="req-3", recovery_root_request_id=None, latest_user_message_id=None
    ) == ("req-3:")


# --------------------------------------------------------------------------------------------------------
# Config resolution and validation
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [True, False, None])
def test_config_true_false_and_none_resolve_to_defaults(raw: bool | None) -> None:
    resolved = resolve_chat_recovery(raw)
    assert resolved == ChatRecovery()
    assert resolved.max_attempts == 10
    assert resolved.stable_timeout_ms == 10_000
    assert resolved.no_progress_timeout_ms == 300_000
    assert resolved.max_recovery_work == 1000
    assert resolved.max_oom_retries == 3
    assert resolved.terminal_message == DEFAULT_TERMINAL_MESSAGE
    assert resolved.should_keep_recovering is None
    assert resolved.on_exhausted is None


def test_config_instance_resolves_to_itself() -> None:
    config = ChatRecovery(max_attempts=6)
    assert resolve_chat_recovery(config) is config


@pytest.mark.parametrize("raw", [{"max_attempts": 6}, 1, "yes"])
def test_config_resolution_rejects_other_types(raw: Any) -> None:
    with pytest.raises(ValueError, match="chat_recovery must be a ChatRecovery, True, False or None"):
        resolve_chat_recovery(raw)


def test_config_hooks_pass_through() -> None:
    def keep(ctx: ProgressContext) -> bool:
        return True

    async def on_exhausted(ctx: ExhaustedContext) -> None:
        return None

    config = ChatRecovery(should_keep_recovering=keep, on_exhausted=on_exhausted)
    assert config.should_keep_recovering is keep
    assert config.on_exhausted is on_exhausted


def test_config_accepts_sync_on_exhausted() -> None:
    def on_exhausted(ctx: ExhaustedContext) -> None:
        return None

    assert ChatRecovery(on_exhausted=on_exhausted).on_exhausted is on_exhausted


@pytest.mark.parametrize(
    ("field", "value", "stored"),
    [
        ("max_attempts", 1, 1),
        ("max_attempts", 6.0, 6),
        ("stable_timeout_ms", 0, 0),
        ("no_progress_timeout_ms", 0, 0),
        ("no_progress_timeout_ms", 1234.0, 1234),
        ("max_oom_retries", 0, 0),
        ("max_oom_retries", 2.0, 2),
        ("max_recovery_work", 0, 0),
        ("max_recovery_work", 5.0, 5),
        ("max_recovery_work", math.inf, math.inf),
    ],
)
def test_config_accepts_boundaries_and_integral_floats(field: str, value: Any, stored: Any) -> None:
    config = ChatRecovery(**{field: value})
    assert getattr(config, field) == stored
    assert type(getattr(config, field)) is type(stored)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_attempts", 0, r"ChatRecovery\.max_attempts must be an int >= 1; got 0"),
        ("max_attempts", -3, r"ChatRecovery\.max_attempts must be an int >= 1; got -3"),
        ("max_attempts", 6.5, r"ChatRecovery\.max_attempts must be an int >= 1; got 6\.5"),
        ("max_attempts", True, r"ChatRecovery\.max_attempts must be an int >= 1; got True"),
        ("max_attempts", "6", r"ChatRecovery\.max_attempts must be an int >= 1; got '6'"),
        ("max_attempts", None, r"ChatRecovery\.max_attempts must be an int >= 1; got None"),
        ("max_attempts", math.inf, r"ChatRecovery\.max_attempts must be an int >= 1; got inf"),
        ("stable_timeout_ms", -5, r"ChatRecovery\.stable_timeout_ms must be an int >= 0; got -5"),
        ("stable_timeout_ms", 0.5, r"ChatRecovery\.stable_timeout_ms must be an int >= 0; got 0\.5"),
        ("no_progress_timeout_ms", -1, r"ChatRecovery\.no_progress_timeout_ms must be an int >= 0; got -1"),
        (
            "no_progress_timeout_ms",
            math.nan,
            r"ChatRecovery\.no_progress_timeout_ms must be an int >= 0; got nan",
        ),
        ("max_oom_retries", -1, r"ChatRecovery\.max_oom_retries must be an int >= 0; got -1"),
        ("max_oom_retries", 1.5, r"ChatRecovery\.max_oom_retries must be an int >= 0; got 1\.5"),
        ("max_oom_retries", False, r"ChatRecovery\.max_oom_retries must be an int >= 0; got False"),
        (
            "max_recovery_work",
            -1,
            r"ChatRecovery\.max_recovery_work must be an int >= 0 or math\.inf; got -1",
        ),
        ("max_recovery_work", math.nan, r"max_recovery_work must be an int >= 0 or math\.inf; got nan"),
        ("max_recovery_work", -math.inf, r"max_recovery_work must be an int >= 0 or math\.inf; got -inf"),
        ("max_recovery_work", 2.5, r"max_recovery_work must be an int >= 0 or math\.inf; got 2\.5"),
        ("max_recovery_work", True, r"max_recovery_work must be an int >= 0 or math\.inf; got True"),
        ("max_recovery_work", "1000", r"max_recovery_work must be an int >= 0 or math\.inf; got '1000'"),
        ("terminal_message", "", r"ChatRecovery\.terminal_message must be a non-empty string; got ''"),
        ("terminal_message", "   ", r"ChatRecovery\.terminal_message must be a non-empty string; got '   '"),
        ("terminal_message", None, r"ChatRecovery\.terminal_message must be a non-empty string; got None"),
        ("should_keep_recovering", "yes", r"ChatRecovery\.should_keep_recovering must be a callable or None"),
        (
            "on_exhausted",
            42,
            r"ChatRecovery\.on_exhausted must be a callable \(sync or async\) or None; got 42",
        ),
    ],
)
def test_config_rejects_invalid_values_with_field_and_range(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChatRecovery(**{field: value})


def test_config_rejects_async_should_keep_recovering() -> None:
    async def keep(ctx: ProgressContext) -> bool:
        return True

    with pytest.raises(ValueError, match=r"should_keep_recovering must be a synchronous callable"):
        ChatRecovery(should_keep_recovering=keep)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------------
# Stale selection and live listing
# --------------------------------------------------------------------------------------------------------


def test_stale_selection_only_incidents_inactive_more_than_1h() -> None:
    fresh = incident(incident_id="a", last_attempt_at=T0)
    boundary = incident(incident_id="b", last_attempt_at=T0 - INCIDENT_TTL_MS)
    stale = incident(incident_id="c", last_attempt_at=T0 - INCIDENT_TTL_MS - 1)
    assert stale_ids([fresh, boundary, stale], now_ms=T0) == ["c"]
    assert not is_stale(boundary, now_ms=T0)
    assert is_stale(stale, now_ms=T0)


def test_stale_selection_uses_last_attempt_not_first_seen() -> None:
    # An old incident that was re-evaluated recently is still active.
    old_but_active = incident(first_seen_at=T0 - 5 * INCIDENT_TTL_MS, last_attempt_at=T0 - 1)
    assert stale_ids([old_but_active], now_ms=T0) == []


def test_stale_selection_of_nothing_is_empty() -> None:
    assert stale_ids([], now_ms=T0) == []


def test_live_listing_returns_only_detected_scheduled_attempting() -> None:
    statuses = ["detected", "scheduled", "attempting", "completed", "skipped", "exhausted", "failed"]
    records = [incident(incident_id=status, status=status) for status in statuses]
    assert [record.incident_id for record in live_incidents(records)] == [
        "detected",
        "scheduled",
        "attempting",
    ]


# --------------------------------------------------------------------------------------------------------
# Evaluation: opening and attempts
# --------------------------------------------------------------------------------------------------------


def test_opens_incident_with_detected() -> None:
    result = evaluate()
    assert result.opened is True
    assert result.exhausted is False
    assert result.reason is None
    assert result.predicate_error is None
    assert result.incident == Incident(
        incident_id="root-1:user-1",
        request_id="req-1",
        recovery_root_request_id="root-1",
        recovery_kind="continue",
        attempt=1,
        max_attempts=10,
        status="attempting",
        first_seen_at=T0,
        last_attempt_at=T0,
        last_progress_at=T0,
        reason=None,
        progress=0,
        work_baseline=0,
        oom_attempts=0,
    )


def test_existing_incident_emits_attempt_only() -> None:
    result = evaluate(existing=opened(), now_ms=T0 + PAST_DEBOUNCE, request_id="req-2")
    assert result.opened is False
    assert result.incident.first_seen_at == T0
    assert result.incident.request_id == "req-2"  # the current attempt's id


def test_retry_and_continue_share_one_budget() -> None:
    first = evaluate(recovery_kind="retry").incident
    second = evaluate(existing=first, recovery_kind="continue", now_ms=T0 + PAST_DEBOUNCE).incident
    assert second.incident_id == first.incident_id
    assert second.attempt == 2
    assert second.recovery_kind == "continue"


def test_no_attempts_spent_inside_30s_debounce() -> None:
    result = evaluate(existing=opened(), now_ms=T0 + INCIDENT_DEBOUNCE_MS - 1)
    assert result.incident.attempt == 1
    assert result.exhausted is False


def test_attempts_advance_outside_debounce() -> None:
    assert evaluate(existing=opened(), now_ms=T0 + INCIDENT_DEBOUNCE_MS).incident.attempt == 2


def test_debounce_refreshes_last_attempt_so_a_storm_keeps_attempt_fixed_until_no_progress() -> None:
    record = opened()
    now = T0
    # A detection every 20 s: each one lands inside the window opened by the previous one.
    while not (result := evaluate(existing=record, now_ms=(now := now + 20_000))).exhausted:
        assert result.incident.attempt == 1
        assert result.incident.last_attempt_at == now
        record = result.incident
    assert result.reason == "no_progress_timeout"
    assert now - T0 > NO_PROGRESS_MS


def test_progress_resets_attempt_to_1() -> None:
    existing = opened(attempt=7, progress=3, work_baseline=0, last_progress_at=T0)
    now = T0 + 10 * INCIDENT_DEBOUNCE_MS
    result = evaluate(existing=existing, progress=5, now_ms=now)
    assert result.incident.attempt == 1
    assert result.incident.last_progress_at == now
    assert result.incident.progress == 5


def test_progress_inside_debounce_still_resets_attempt() -> None:
    existing = opened(attempt=4, progress=3)
    assert evaluate(existing=existing, progress=4, now_ms=T0 + 1).incident.attempt == 1


def test_progress_high_water_mark_never_goes_down() -> None:
    existing = opened(progress=9, work_baseline=2)
    result = evaluate(existing=existing, progress=4, now_ms=T0 + PAST_DEBOUNCE)
    assert result.incident.progress == 9
    assert result.incident.work_baseline == 2


def test_legacy_record_without_last_progress_counts_from_first_seen() -> None:
    existing = opened(last_progress_at=None, progress=None, work_baseline=None)
    assert evaluate(existing=existing, now_ms=T0 + NO_PROGRESS_MS).exhausted is False
    result = evaluate(existing=existing, now_ms=T0 + NO_PROGRESS_MS + 1)
    assert result.reason == "no_progress_timeout"
    assert result.incident.last_progress_at == T0


# --------------------------------------------------------------------------------------------------------
# Evaluation: exhaustion reasons
# --------------------------------------------------------------------------------------------------------


def test_exhausts_with_max_attempts_exceeded() -> None:
    existing = opened(attempt=10, last_progress_at=T0)
    result = evaluate(existing=existing, now_ms=T0 + PAST_DEBOUNCE)
    assert result.incident.attempt == 11
    assert result.exhausted is True
    assert result.reason == "max_attempts_exceeded"
    assert result.incident.status == "exhausted"
    assert result.incident.reason == "max_attempts_exceeded"


def test_max_attempts_plus_one_detection_exhausts() -> None:
    config = ChatRecovery(max_attempts=3, no_progress_timeout_ms=10 * NO_PROGRESS_MS)
    record: Incident | None = None
    outcomes = []
    for detection in range(4):
        result = evaluate(existing=record, config=config, now_ms=T0 + detection * PAST_DEBOUNCE)
        outcomes.append((result.incident.attempt, result.exhausted))
        record = result.incident
    assert outcomes == [(1, False), (2, False), (3, False), (4, True)]
    assert record is not None and record.reason == "max_attempts_exceeded"


def test_max_attempts_1_exhausts_on_second_detection() -> None:
    config = ChatRecovery(max_attempts=1)
    first = evaluate(config=config)
    assert first.exhausted is False
    assert evaluate(existing=first.incident, config=config, now_ms=T0 + PAST_DEBOUNCE).exhausted is True


def test_no_progress_timeout() -> None:
    existing = opened(attempt=2, last_progress_at=T0)
    assert evaluate(existing=existing, now_ms=T0 + NO_PROGRESS_MS).exhausted is False
    result = evaluate(existing=existing, now_ms=T0 + NO_PROGRESS_MS + 1)
    assert result.exhausted is True
    assert result.reason == "no_progress_timeout"


def test_no_progress_timeout_zero_seals_any_later_detection_without_progress() -> None:
    config = ChatRecovery(no_progress_timeout_ms=0)
    assert evaluate(existing=opened(), config=config, now_ms=T0 + 1).reason == "no_progress_timeout"
    # Progress refreshes the clock, so the same detection with progress is fine.
    assert evaluate(existing=opened(), config=config, progress=1, now_ms=T0 + 1).exhausted is False


def test_work_budget_exceeded() -> None:
    existing = opened(attempt=2, work_baseline=0, progress=0, last_progress_at=T0)
    config = ChatRecovery(max_recovery_work=2)
    assert (
        evaluate(existing=existing, config=config, progress=2, now_ms=T0 + PAST_DEBOUNCE).exhausted is False
    )
    result = evaluate(existing=existing, config=config, progress=3, now_ms=T0 + PAST_DEBOUNCE)
    assert result.exhausted is True
    assert result.reason == "work_budget_exceeded"


def test_work_budget_zero_seals_any_progress_after_open() -> None:
    config = ChatRecovery(max_recovery_work=0)
    first = evaluate(config=config, progress=5).incident
    assert evaluate(existing=first, config=config, progress=5, now_ms=T0 + PAST_DEBOUNCE).exhausted is False
    result = evaluate(existing=first, config=config, progress=6, now_ms=T0 + PAST_DEBOUNCE)
    assert result.reason == "work_budget_exceeded"


def test_infinite_work_never_exhausts() -> None:
    existing = opened(attempt=2, work_baseline=0, progress=100, last_progress_at=T0)
    config = ChatRecovery(max_recovery_work=math.inf)
    result = evaluate(existing=existing, config=config, progress=1_000_000, now_ms=T0 + 1_000)
    assert result.exhausted is False
    assert result.incident.status == "attempting"


def test_work_budget_not_checked_on_first_detection() -> None:
    # The baseline is the counter at open, so an opening can never have spent any work.
    result = evaluate(config=ChatRecovery(max_recovery_work=0), progress=10_000)
    assert result.exhausted is False


# --------------------------------------------------------------------------------------------------------
# Evaluation: the caller predicate
# --------------------------------------------------------------------------------------------------------


def test_predicate_true_keeps_going() -> None:
    keep = Recorder(True)
    result = evaluate(
        existing=opened(), config=ChatRecovery(should_keep_recovering=keep), now_ms=T0 + PAST_DEBOUNCE
    )
    assert result.exhausted is False
    assert len(keep.calls) == 1


def test_predicate_false_gives_recovery_aborted() -> None:
    stop = Recorder(False)
    result = evaluate(
        existing=opened(), config=ChatRecovery(should_keep_recovering=stop), now_ms=T0 + PAST_DEBOUNCE
    )
    assert result.exhausted is True
    assert result.reason == "recovery_aborted"
    assert result.incident.status == "exhausted"


def test_predicate_receives_progress_context() -> None:
    keep = Recorder(True)
    existing = opened(attempt=2, work_baseline=3, progress=5)
    now = T0 + 2 * PAST_DEBOUNCE
    evaluate(
        existing=existing,
        config=ChatRecovery(max_attempts=6, should_keep_recovering=keep),
        progress=8,
        now_ms=now,
        recovery_kind="retry",
        request_id="req-9",
    )
    assert keep.calls == [
        ProgressContext(
            incident_id="root-1:user-1",
            request_id="req-9",
            recovery_root_request_id="root-1",
            attempt=1,  # progress was made, so this attempt counts as the first again
            max_attempts=6,
            recovery_kind="retry",
            work=5,
            age_ms=now - T0,
        )
    ]


def test_predicate_only_false_aborts() -> None:
    # Like the reference's `=== false`: a hook that forgets to return (None) does not seal the turn.
    def forgetful(ctx: ProgressContext) -> bool:
        return None  # type: ignore[return-value]

    config = ChatRecovery(should_keep_recovering=forgetful)
    assert evaluate(existing=opened(), config=config, now_ms=T0 + PAST_DEBOUNCE).exhausted is False


def test_predicate_throw_is_keep_going_and_reported() -> None:
    boom = RuntimeError("boom")

    def broken(ctx: ProgressContext) -> bool:
        raise boom

    result = evaluate(
        existing=opened(), config=ChatRecovery(should_keep_recovering=broken), now_ms=T0 + PAST_DEBOUNCE
    )
    assert result.exhausted is False
    assert result.incident.status == "attempting"
    assert result.predicate_error is boom


def test_predicate_returning_awaitable_is_keep_going_and_reported() -> None:
    async def verdict() -> bool:
        return False

    def sneaky(ctx: ProgressContext) -> bool:
        return verdict()  # type: ignore[return-value]

    result = evaluate(
        existing=opened(), config=ChatRecovery(should_keep_recovering=sneaky), now_ms=T0 + PAST_DEBOUNCE
    )
    assert result.exhausted is False
    assert isinstance(result.predicate_error, TypeError)


def test_predicate_not_consulted_on_first_detection() -> None:
    stop = Recorder(False)
    result = evaluate(config=ChatRecovery(should_keep_recovering=stop))
    assert stop.calls == []
    assert result.exhausted is False


@pytest.mark.parametrize(
    ("existing_changes", "config_changes", "progress", "now_ms", "reason"),
    [
        pytest.param({"attempt": 2}, {}, 0, T0 + NO_PROGRESS_MS + 1, "no_progress_timeout", id="no_progress"),
        pytest.param(
            {"attempt": 2}, {"max_recovery_work": 1}, 5, T0 + PAST_DEBOUNCE, "work_budget_exceeded", id="work"
        ),
        pytest.param({"oom_attempts": 4}, {}, 0, T0 + PAST_DEBOUNCE, "out_of_memory", id="oom"),
        pytest.param({"attempt": 10}, {}, 0, T0 + PAST_DEBOUNCE, "max_attempts_exceeded", id="attempts"),
    ],
)
def test_hard_bounds_take_precedence_over_predicate(
    existing_changes: dict[str, int], config_changes: dict[str, Any], progress: int, now_ms: int, reason: str
) -> None:
    keep = Recorder(True)
    config = ChatRecovery(should_keep_recovering=keep, **config_changes)
    result = evaluate(existing=opened(**existing_changes), config=config, progress=progress, now_ms=now_ms)
    assert keep.calls == []
    assert result.reason == reason


# --------------------------------------------------------------------------------------------------------
# Evaluation: client interaction, work baseline, OOM
# --------------------------------------------------------------------------------------------------------


def test_pending_client_interaction_removes_the_budget() -> None:
    # At the attempt cap, far past the no-progress window, over the work and OOM budgets, predicate says stop.
    existing = opened(attempt=10, last_progress_at=T0, oom_attempts=9)
    stop = Recorder(False)
    now = T0 + 10 * NO_PROGRESS_MS
    config = ChatRecovery(should_keep_recovering=stop, max_recovery_work=0)
    result = evaluate(existing=existing, config=config, progress=50, now_ms=now, awaiting=True)
    assert result.exhausted is False
    assert result.reason is None
    assert result.incident.status == "attempting"
    assert result.incident.reason is None
    assert stop.calls == []
    assert result.incident.last_progress_at == now  # a full window once the human answers


def test_pending_client_interaction_keeps_no_progress_clock_fresh() -> None:
    parked = evaluate(existing=opened(), now_ms=T0 + 10 * NO_PROGRESS_MS, awaiting=True).incident
    # The human answered; the next detection shortly after has a fresh window.
    after = evaluate(existing=parked, now_ms=T0 + 10 * NO_PROGRESS_MS + PAST_DEBOUNCE)
    assert after.exhausted is False


def test_work_baseline_captured_at_open() -> None:
    result = evaluate(progress=4)
    assert result.incident.work_baseline == 4
    assert result.incident.progress == 4
    later = evaluate(existing=result.incident, progress=9, now_ms=T0 + PAST_DEBOUNCE)
    assert later.incident.work_baseline == 4


def test_oom_crash_loop_sealed_by_default_work_budget() -> None:
    # Each OOM-ing re-run streams a little before dying: progress resets the attempt cap and the no-progress
    # clock every time, so without the work budget this would loop forever (#1825).
    record: Incident | None = None
    now, counter = T0, 0
    for _ in range(100):
        result = evaluate(existing=record, progress=counter, now_ms=now)
        if result.exhausted:
            break
        assert result.incident.attempt == 1
        record = result.incident
        now, counter = now + 60_000, counter + 150
    assert result.exhausted is True
    assert result.reason == "work_budget_exceeded"
    assert counter == 1050  # the first detection with work > 1000


def test_oom_attempts_carried_forward_and_seal_when_over_budget() -> None:
    under = evaluate(existing=opened(oom_attempts=3), now_ms=T0 + PAST_DEBOUNCE)
    assert under.exhausted is False
    assert under.incident.oom_attempts == 3
    over = evaluate(existing=opened(oom_attempts=4), now_ms=T0 + PAST_DEBOUNCE)
    assert over.exhausted is True
    assert over.reason == "out_of_memory"
    assert over.incident.oom_attempts == 4


def test_oom_budget_seals_even_while_making_progress() -> None:
    result = evaluate(existing=opened(oom_attempts=4), progress=1, now_ms=T0 + 1)
    assert result.incident.attempt == 1
    assert result.reason == "out_of_memory"


def test_no_oom_seal_while_interaction_pending() -> None:
    result = evaluate(existing=opened(oom_attempts=10), now_ms=T0 + PAST_DEBOUNCE, awaiting=True)
    assert result.exhausted is False
    assert result.incident.oom_attempts == 10


def test_evaluation_does_not_touch_the_existing_record() -> None:
    existing = opened(attempt=3)
    snapshot = replace(existing)
    evaluate(existing=existing, progress=7, now_ms=T0 + PAST_DEBOUNCE)
    assert existing == snapshot


# --------------------------------------------------------------------------------------------------------
# Reason precedence
# --------------------------------------------------------------------------------------------------------


# Written out rather than read from EXHAUSTION_REASONS, so reordering the module's tuple fails these tests.
PRECEDENCE = (
    "out_of_memory",
    "work_budget_exceeded",
    "no_progress_timeout",
    "recovery_aborted",
    "max_attempts_exceeded",
)


def expected_reason(fired: set[str]) -> str | None:
    return next((reason for reason in PRECEDENCE if reason in fired), None)


@pytest.mark.parametrize("tripped", list(itertools.product([False, True], repeat=len(PRECEDENCE))))
def test_reason_precedence_across_all_combinations(tripped: tuple[bool, ...]) -> None:
    fired = {reason for reason, on in zip(PRECEDENCE, tripped, strict=True) if on}
    assert first_exhaustion_reason(fired) == expected_reason(fired)


@pytest.mark.parametrize(
    ("fired", "reason"),
    [
        ({"max_attempts_exceeded", "out_of_memory"}, "out_of_memory"),
        ({"no_progress_timeout", "work_budget_exceeded"}, "work_budget_exceeded"),
        ({"recovery_aborted", "no_progress_timeout"}, "no_progress_timeout"),
        ({"max_attempts_exceeded", "recovery_aborted"}, "recovery_aborted"),
        ({"stable_timeout"}, None),
        (set(), None),
    ],
)
def test_reason_precedence_examples(fired: set[str], reason: str | None) -> None:
    assert first_exhaustion_reason(fired) == reason


HARD_BOUNDS = ("out_of_memory", "work_budget_exceeded", "no_progress_timeout", "max_attempts_exceeded")


@pytest.mark.parametrize("tripped", list(itertools.product([False, True], repeat=len(HARD_BOUNDS))))
def test_evaluation_reason_precedence_across_hard_bound_combinations(tripped: tuple[bool, ...]) -> None:
    fired = {bound for bound, on in zip(HARD_BOUNDS, tripped, strict=True) if on}
    # Each bound is tripped on its own lever, without progress in this detection so none resets another.
    existing = opened(
        oom_attempts=4 if "out_of_memory" in fired else 0,
        progress=1001 if "work_budget_exceeded" in fired else 0,
        work_baseline=0,
        attempt=10 if "max_attempts_exceeded" in fired else 1,
        last_progress_at=T0,
    )
    now = T0 + (NO_PROGRESS_MS + 1 if "no_progress_timeout" in fired else PAST_DEBOUNCE)
    stop = Recorder(False)
    result = evaluate(
        existing=existing,
        config=ChatRecovery(should_keep_recovering=stop),
        progress=existing.progress or 0,
        now_ms=now,
    )
    expected = expected_reason(fired) or "recovery_aborted"
    assert result.reason == expected
    assert result.exhausted is True
    # The predicate only runs when no hard bound fired.
    assert len(stop.calls) == (0 if fired else 1)


# --------------------------------------------------------------------------------------------------------
# Schedule policy
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "idempotent"),
    [("initial", True), ("stable_timeout", False), ("oom", False), ("transient", False)],
)
def test_schedule_policy(reason: str, idempotent: bool) -> None:
    assert schedule_is_idempotent(reason) is idempotent


# --------------------------------------------------------------------------------------------------------
# The wait after a transient model error (a 5xx, a broken stream, a rate limit)
# --------------------------------------------------------------------------------------------------------


def test_a_first_transient_failure_waits_the_minimum() -> None:
    assert transient_wait_s(opened(), now_ms=T0) == TRANSIENT_WAIT_MIN_S == 1.0


def test_back_to_back_failures_without_progress_wait_as_long_again_so_the_wait_doubles() -> None:
    record, now, waits = opened(), T0, []
    for _ in range(7):
        wait = transient_wait_s(record, now_ms=now)
        waits.append(wait)
        now += int(wait * 1000)  # the next attempt fails as soon as it starts
        record = evaluate(existing=record, now_ms=now).incident
    assert waits == [1.0, 1.0, 2.0, 4.0, 8.0, 16.0, TRANSIENT_WAIT_MAX_S]


def test_progress_brings_the_wait_back_to_the_minimum() -> None:
    record = evaluate(existing=opened(), now_ms=T0 + 20_000, progress=3).incident
    assert transient_wait_s(record, now_ms=T0 + 20_000) == TRANSIENT_WAIT_MIN_S


def test_the_wait_is_capped() -> None:
    assert transient_wait_s(opened(), now_ms=T0 + 3_600_000) == TRANSIENT_WAIT_MAX_S == 30.0


@pytest.mark.parametrize(
    ("retry_after", "wait"),
    [
        (None, 1.0),
        (0.0, 1.0),
        (-5.0, 1.0),
        (math.nan, 1.0),
        (math.inf, 1.0),
        (0.5, 1.0),  # never below the backoff
        (7.0, 7.0),
        (RETRY_AFTER_MAX_S + 1000, RETRY_AFTER_MAX_S),  # a quota reset an hour away is not waited for
    ],
)
def test_a_retry_after_raises_the_wait_up_to_a_cap(retry_after: float | None, wait: float) -> None:
    assert transient_wait_s(opened(), now_ms=T0, retry_after_s=retry_after) == wait


def test_a_retry_after_shorter_than_the_backoff_does_not_shorten_it() -> None:
    assert transient_wait_s(opened(), now_ms=T0 + 10_000, retry_after_s=2) == 10.0


@pytest.mark.parametrize("reason", ["", "stable_timeout_retry", "INITIAL", "retry"])
def test_schedule_policy_is_exhaustive(reason: str) -> None:
    with pytest.raises(ValueError, match="unknown schedule reason"):
        schedule_is_idempotent(reason)


# --------------------------------------------------------------------------------------------------------
# Stable-timeout reschedule
# --------------------------------------------------------------------------------------------------------


def test_stable_timeout_reschedule_increments_attempt_and_stores_scheduled() -> None:
    record = incident(attempt=2, max_attempts=6, reason=None)
    rescheduled = reschedule_after_stable_timeout(record, config=ChatRecovery(), now_ms=4_242)
    assert rescheduled == replace(
        record, attempt=3, status="scheduled", reason="stable_timeout_retry", last_attempt_at=4_242
    )


def test_stable_timeout_reschedule_refuses_missing_record() -> None:
    assert reschedule_after_stable_timeout(None, config=ChatRecovery(), now_ms=T0) is None


@pytest.mark.parametrize("attempt", [6, 7])
def test_stable_timeout_reschedule_refuses_spent_budget(attempt: int) -> None:
    record = incident(attempt=attempt, max_attempts=6)
    assert reschedule_after_stable_timeout(record, config=ChatRecovery(max_attempts=100), now_ms=T0) is None


def test_stable_timeout_reschedule_last_allowed_attempt() -> None:
    rescheduled = reschedule_after_stable_timeout(
        incident(attempt=5, max_attempts=6), config=ChatRecovery(), now_ms=T0
    )
    assert rescheduled is not None and rescheduled.attempt == 6


def test_stable_timeout_reschedule_uses_record_cap_over_config() -> None:
    record = incident(attempt=3, max_attempts=3)
    assert reschedule_after_stable_timeout(record, config=ChatRecovery(max_attempts=10), now_ms=T0) is None


def test_stable_timeout_reschedule_falls_back_to_config_max_attempts() -> None:
    # A record without a cap (stored as 0) uses the config's.
    record = incident(attempt=2, max_attempts=0)
    assert reschedule_after_stable_timeout(record, config=ChatRecovery(max_attempts=2), now_ms=T0) is None
    rescheduled = reschedule_after_stable_timeout(record, config=ChatRecovery(max_attempts=3), now_ms=T0)
    assert rescheduled is not None and rescheduled.attempt == 3


# --------------------------------------------------------------------------------------------------------
# OOM decisions
# --------------------------------------------------------------------------------------------------------


def test_oom_reschedules_while_under_budget() -> None:
    record = incident(attempt=1)
    updated, exhausted = record_oom_and_decide(record, config=ChatRecovery(max_oom_retries=3), now_ms=4_242)
    assert exhausted is False
    assert updated == replace(
        record, oom_attempts=1, status="scheduled", reason="oom_retry", last_attempt_at=4_242
    )
    assert (
        updated is not None and updated.attempt == 1
    )  # OOM has its own budget; the attempt cap is untouched


def test_oom_exhausted_when_over_budget() -> None:
    record = incident(oom_attempts=3)
    updated, exhausted = record_oom_and_decide(record, config=ChatRecovery(max_oom_retries=3), now_ms=4_242)
    assert exhausted is True
    assert updated is not None
    assert updated.oom_attempts == 4
    assert updated.reason == "out_of_memory"
    # Not sealed here: the give-up spine's re-entry guard would otherwise skip the terminal banner.
    assert updated.status == "attempting"


def test_oom_count_agrees_with_the_begin_path() -> None:
    updated, exhausted = record_oom_and_decide(incident(oom_attempts=3), config=ChatRecovery(), now_ms=T0)
    assert exhausted is True and updated is not None
    later = evaluate(existing=replace(opened(), oom_attempts=updated.oom_attempts), now_ms=T0 + PAST_DEBOUNCE)
    assert later.reason == "out_of_memory"


def test_oom_max_oom_retries_0_seals_on_first_oom() -> None:
    updated, exhausted = record_oom_and_decide(incident(), config=ChatRecovery(max_oom_retries=0), now_ms=T0)
    assert exhausted is True
    assert updated is not None and updated.oom_attempts == 1


def test_oom_missing_record_is_exhausted() -> None:
    assert record_oom_and_decide(None, config=ChatRecovery(), now_ms=T0) == (None, True)


def test_oom_sequence_with_default_budget() -> None:
    record: Incident | None = incident()
    decisions = []
    for _ in range(4):
        record, exhausted = record_oom_and_decide(record, config=ChatRecovery(), now_ms=T0)
        decisions.append(exhausted)
    assert decisions == [False, False, False, True]


# --------------------------------------------------------------------------------------------------------
# Exhausted context
# --------------------------------------------------------------------------------------------------------


def test_exhausted_context_maps_every_field() -> None:
    record = incident(attempt=7, max_attempts=6, recovery_kind="retry", reason="no_progress_timeout")
    parts = [{"type": "text", "text": "half an answer"}]
    ctx = exhausted_context(
        record,
        config=ChatRecovery(terminal_message="Gave up."),
        stream_id="stream-1",
        created_at=1_000,
        partial_text="half an answer",
        partial_parts=parts,
    )
    assert ctx == ExhaustedContext(
        incident_id="root-1:user-1",
        request_id="req-1",
        recovery_root_request_id="root-1",
        attempt=7,
        max_attempts=6,
        recovery_kind="retry",
        stream_id="stream-1",
        created_at=1_000,
        partial_text="half an answer",
        partial_parts=parts,
        reason="no_progress_timeout",
        terminal_message="Gave up.",
    )
    assert ctx.partial_parts is not parts  # a hook mutating its copy cannot touch the caller's parts


def test_exhausted_context_root_falls_back_to_request_id() -> None:
    ctx = exhausted_context(
        incident(recovery_root_request_id=""),
        config=ChatRecovery(),
        stream_id="",
        created_at=0,
        partial_text="",
        partial_parts=[],
    )
    assert ctx.recovery_root_request_id == "req-1"
    assert ctx.stream_id == ""


def test_exhausted_context_reason_falls_back_to_max_attempts_exceeded() -> None:
    ctx = exhausted_context(
        incident(reason=None),
        config=ChatRecovery(),
        stream_id="s",
        created_at=0,
        partial_text="",
        partial_parts=[],
    )
    assert ctx.reason == "max_attempts_exceeded"
    assert ctx.terminal_message == DEFAULT_TERMINAL_MESSAGE


@pytest.mark.parametrize("reason", ["stable_timeout", "recovery_error", "out_of_memory"])
def test_exhausted_context_threads_callback_reasons(reason: str) -> None:
    ctx = exhausted_context(
        incident(reason=reason),
        config=ChatRecovery(),
        stream_id="s",
        created_at=0,
        partial_text="",
        partial_parts=[],
    )
    assert ctx.reason == reason


# --------------------------------------------------------------------------------------------------------
# The recovery's spend: max_recovery_tokens, max_recovery_cost
# --------------------------------------------------------------------------------------------------------


def spend_evaluate(existing: Incident | None, spent: Spend, config: ChatRecovery) -> Evaluation:
    return evaluate_incident(
        existing=existing,
        incident_id="root-1:user-1",
        request_id="req-2",
        recovery_root_request_id="root-1",
        recovery_kind="continue",
        progress=5,
        config=config,
        now_ms=T0,
        awaiting=False,
        spent=spent,
    )


def test_the_turn_that_opens_an_incident_spends_nothing_of_its_budget() -> None:
    config = ChatRecovery(max_recovery_tokens=10)
    evaluation = spend_evaluate(None, Spend(10_000, Decimal("9")), config)
    assert not evaluation.exhausted
    assert (evaluation.incident.spent_tokens, evaluation.incident.spent_cost) == (0, None)


def test_an_interrupted_attempt_adds_its_spend_and_over_the_token_bound_exhausts() -> None:
    config = ChatRecovery(max_recovery_tokens=100)
    fresh = incident(progress=5, last_attempt_at=T0 - PAST_DEBOUNCE, last_progress_at=T0)
    first = spend_evaluate(fresh, Spend(60, None), config)
    assert not first.exhausted and first.incident.spent_tokens == 60
    second = spend_evaluate(replace(first.incident, last_attempt_at=T0 - PAST_DEBOUNCE), Spend(41), config)
    assert second.exhausted and second.reason == "cost_budget_exceeded"
    assert second.incident.spent_tokens == 101 and second.incident.status == "exhausted"


def test_the_cost_bound_counts_priced_attempts_exactly() -> None:
    config = ChatRecovery(max_recovery_cost=Decimal("0.0010"))
    existing = incident(
        progress=5, spent_cost=Decimal("0.0006"), last_attempt_at=T0 - PAST_DEBOUNCE, last_progress_at=T0
    )
    at_bound = spend_evaluate(existing, Spend(10, Decimal("0.0004")), config)
    assert not at_bound.exhausted and at_bound.incident.spent_cost == Decimal("0.0010"), "at the bound is in"
    over = spend_evaluate(existing, Spend(10, Decimal("0.0004000001")), config)
    assert over.reason == "cost_budget_exceeded"
    unpriced = spend_evaluate(existing, Spend(10, None), config)
    assert not unpriced.exhausted and unpriced.incident.spent_cost == Decimal("0.0006")


def test_cost_budget_exceeded_comes_before_the_other_bounds_but_out_of_memory() -> None:
    assert first_exhaustion_reason(
        {"cost_budget_exceeded", "max_attempts_exceeded", "work_budget_exceeded"}
    ) == ("cost_budget_exceeded")
    assert first_exhaustion_reason({"cost_budget_exceeded", "out_of_memory"}) == "out_of_memory"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_recovery_tokens": 0}, "max_recovery_tokens must be an int >= 1"),
        ({"max_recovery_tokens": 2.5}, "max_recovery_tokens must be an int >= 1"),
        ({"max_recovery_cost": 0.5}, "not a float"),
        ({"max_recovery_cost": Decimal("0")}, "a Decimal above 0"),
        ({"max_recovery_cost": Decimal("NaN")}, "a Decimal above 0"),
        ({"max_recovery_cost": "1"}, "not a float"),
    ],
)
def test_a_bad_spend_bound_is_refused_clearly(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChatRecovery(**changes)


def test_spend_bounds_accept_ints_and_decimals() -> None:
    config = ChatRecovery(max_recovery_tokens=5000, max_recovery_cost=2)
    assert config.max_recovery_cost == Decimal(2) and isinstance(config.max_recovery_cost, Decimal)
