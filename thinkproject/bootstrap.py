"""Start-up chores of `make run` and docker-compose, run once before web, worker and beat start.

python -m thinkproject.bootstrap            # create the Postgres database if it is missing
python -m thinkproject.bootstrap metrics    # empty PROMETHEUS_MULTIPROC_DIR (when it is set)
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import psycopg
from psycopg import sql

logger = logging.getLogger("thinkproject.bootstrap")


def ensure_database() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "thinkproject.settings")
    from django.conf import settings

    db = settings.DATABASES["default"]
    params = {"host": db["HOST"], "port": db["PORT"], "user": db["USER"], "password": db["PASSWORD"]}
    with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db["NAME"]]).fetchone()
        if exists is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db["NAME"])))
            logger.warning("created database %s", db["NAME"])


def reset_metrics_dir() -> Path | None:
    """Empty (or create) the prometheus_client multiprocess directory, as its docs ask at every start:
    files left by an earlier run would be added to this run's counters. Only its contents go, since it
    may be a mounted volume."""
    value = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not value:
        return None
    path = Path(value)
    path.mkdir(parents=True, exist_ok=True)
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    logger.info("emptied metrics directory %s", path)
    return path


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if sys.argv[1:] == ["metrics"]:
        reset_metrics_dir()
    else:
        ensure_database()
