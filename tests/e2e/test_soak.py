"""A short soak in every test run: bench/soak.py with a fixed seed, ten rounds of a worker SIGKILLed at a
random point of a turn (before its first chunk, mid-stream, near the end, or not at all) and replaced.
It fails on any lost, duplicated or stuck turn; the seed makes a failing run replay exactly
(`cd bench && ../.venv/bin/python soak.py --rounds 10 --seed 2026`). bench/soak.py runs the long one.

The soak brings its own stack: a private redis-server, its own database (made and dropped here), the
scripted model, daphne, beat and one worker.
"""

from __future__ import annotations

import pytest

from tests.e2e.benchrun import run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SEED = 2026
ROUNDS = 10


def test_a_short_seeded_soak_loses_nothing() -> None:
    args = ["--rounds", str(ROUNDS), "--seed", str(SEED), "--budget", "90"]
    report = run_bench("soak.py", args, database="thinkproject_soak", timeout=540)
    assert f"rounds: {ROUNDS}" in report and "lost turns: 0" in report, report
    assert "duplicated chunks: 0" in report and "stuck turns: 0" in report, report
    kills = next(line for line in report.splitlines() if line.startswith("kills: "))
    assert int(kills.split()[1]) >= 5, f"the seed kills the worker in most rounds: {kills}"
