"""A short soak in every test run: bench/soak.py with a fixed seed, four rounds of a worker SIGKILLed at a
random point of a turn (before its first chunk, mid-stream, near the end, or not at all) and replaced.
It fails on any lost, duplicated or stuck turn; the seed makes a failing run replay exactly
(`cd bench && ../.venv/bin/python soak.py --rounds 4 --seed 11`): it kills in all four rounds, once
before the first chunk (the retry path) and three times mid-stream. bench/soak.py runs the long one
(docs/benchmarks.md: 100 rounds).

The soak brings its own stack: a private redis-server, its own database (made and dropped here), the
scripted model, daphne, beat and one worker.
"""

from __future__ import annotations

import pytest

from tests.e2e.benchrun import run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SEED = 11
ROUNDS = 4


def test_a_short_seeded_soak_loses_nothing() -> None:
    args = ["--rounds", str(ROUNDS), "--seed", str(SEED), "--budget", "90"]
    report = run_bench("soak.py", args, database="thinkproject_soak", timeout=240)
    assert f"rounds: {ROUNDS}" in report and "lost turns: 0" in report, report
    assert "duplicated chunks: 0" in report and "stuck turns: 0" in report, report
    kills = next(line for line in report.splitlines() if line.startswith("kills: "))
    assert int(kills.split()[1]) >= 3, f"the seed kills the worker in most rounds: {kills}"
    assert "before first chunk 1" in kills, f"the seed kills one turn before its first chunk: {kills}"
