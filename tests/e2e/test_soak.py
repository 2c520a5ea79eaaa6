"""A short soak in every test run: bench/soak.py with a fixed seed, ten rounds of a worker SIGKILLed at a
random point of a turn (before its first chunk, mid-stream, near the end, or not at all) and replaced.
It fails on any lost, duplicated or stuck turn; the seed makes a failing run replay exactly
(`cd bench && ../.venv/bin/python soak.py --rounds 10 --seed 2026`). bench/soak.py runs the long one.

The soak brings its own stack: a private redis-server, its own database (made and dropped here), the
scripted model, daphne, beat and one worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
import pytest
from django.conf import settings

from tests.support import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SEED = 2026
ROUNDS = 10


def test_a_short_seeded_soak_loses_nothing() -> None:
    params = settings.DATABASES["default"]
    name = f"thinkproject_soak_{uuid.uuid4().hex[:8]}"
    server = f"{params['USER']}@{params['HOST']}:{params['PORT'] or 5432}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "THINK_TEST_"))}
    env["BENCH_DATABASE_URL"] = f"postgres://{server}/{name}"
    try:
        result = subprocess.run(
            [sys.executable, "soak.py", "--rounds", str(ROUNDS), "--seed", str(SEED), "--budget", "90"],
            cwd=ROOT / "bench",
            env=env,
            capture_output=True,
            text=True,
            timeout=540,
        )
    finally:
        with psycopg.connect(
            dbname="postgres",
            user=params["USER"],
            host=params["HOST"],
            port=params["PORT"] or 5432,
            autocommit=True,
        ) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert f"rounds: {ROUNDS}" in report and "lost turns: 0" in report, report
    assert "duplicated chunks: 0" in report and "stuck turns: 0" in report, report
    kills = next(line for line in report.splitlines() if line.startswith("kills: "))
    assert int(kills.split()[1]) >= 5, f"the seed kills the worker in most rounds: {kills}"
