"""Overload without loss, small: bench/overload.py with 40 turns at once against one worker with 4
threads, and a limit of 8 turns queued or running per principal over 4 principals. The worker starts
once every turn is accepted or refused (a backlog), so the limit's count does not depend on how fast
the web process accepts: exactly 2 of each principal's 10 are refused. It fails on any turn lost,
duplicated, refused without a clear error or stored though refused, and on any turn that waited for a
worker without being told (cf_agent_chat_queued); every conversation's stored transcript is checked.
bench/overload.py --turns 500 runs the big one.

The benchmark brings its own stack: a private redis-server, its own database (made and dropped here),
the scripted model, daphne, beat and one worker.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.benchrun import run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TURNS, PRINCIPALS, MAX_ACTIVE = 40, 4, 8


def count(report: str, label: str) -> int:
    found = re.search(rf"^{label}: (\d+)", report, re.MULTILINE)
    assert found, f"no {label!r} line in:\n{report}"
    return int(found.group(1))


def test_forty_turns_at_once_complete_or_are_refused_and_none_is_lost() -> None:
    args = ["--turns", str(TURNS), "--concurrency", "4", "--count", "20", "--rate", "20"]
    args += ["--principals", str(PRINCIPALS), "--max-active", str(MAX_ACTIVE), "--budget", "120"]
    args += ["--worker-after-accept"]
    report = run_bench("overload.py", args, database="thinkproject_overload", timeout=240)
    completed, refused = count(report, "completed"), count(report, "refused")
    assert completed + refused == TURNS, report
    assert count(report, "lost") == 0 and count(report, "duplicated") == 0, report
    assert count(report, "other problems") == 0, report
    # Nothing ran before every turn was accepted or refused: each principal's 9th and 10th are refused.
    assert refused == TURNS - PRINCIPALS * MAX_ACTIVE, f"the per-principal limit:\n{report}"
    assert completed == PRINCIPALS * MAX_ACTIVE, report
    assert "you already have 8 turns queued or running" in report, report
    told = re.search(r"^told they were queued: (\d+)", report, re.MULTILINE)
    assert told and int(told.group(1)) >= completed - 8, f"most turns waited for a thread:\n{report}"
