"""Running a script of bench/ from a test: in a database of its own, made by the script and dropped
here whatever happens (tests/e2e/test_soak.py, test_overload.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
from django.conf import settings

from tests.support import ROOT


def run_bench(script: str, args: list[str], *, database: str, timeout: float) -> str:
    """Run bench/<script> with `args` on a fresh database named after `database`; its whole output, and
    its exit status in the assertion that fails when it is not 0."""
    params = settings.DATABASES["default"]
    name = f"{database}_{uuid.uuid4().hex[:8]}"
    server = f"{params['USER']}@{params['HOST']}:{params['PORT'] or 5432}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "THINK_TEST_"))}
    env["BENCH_DATABASE_URL"] = f"postgres://{server}/{name}"
    try:
        result = subprocess.run(
            [sys.executable, script, *args],
            cwd=ROOT / "bench",
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
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
    return report
