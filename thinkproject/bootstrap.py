"""Create the configured Postgres database if it is missing (used by `make run` on a fresh machine)."""

from __future__ import annotations

import logging
import os
import sys

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


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    ensure_database()
