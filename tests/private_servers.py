"""pytest plugin (`-p tests.private_servers` in pyproject.toml): the session's Postgres and Redis.

With DATABASE_URL / REDIS_URL unset and nothing answering on the default ports, a throwaway private
Postgres and Redis (thinkproject/embedded.py) are started under .run/test-*/ before Django's settings
are read (a wrapper around pytest-django's pytest_load_initial_conftests), their URLs are put in the
environment, which the processes the tests start inherit, and they are stopped and deleted when the
session ends. A configured or running server is used as before.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Generator
from pathlib import Path

import pytest

# Importing the thinkproject package imports its Celery app, which defaults DJANGO_SETTINGS_MODULE to
# the demo's settings; pytest-django, which has not read its ini option yet, would take that instead.
_settings_module = os.environ.get("DJANGO_SETTINGS_MODULE")
from thinkproject import embedded  # noqa: E402

if _settings_module is None:
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)

SERVICES = pytest.StashKey[tuple[embedded.Services, Path]]()


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Generator[None, None, None]:
    directory = embedded.scratch_dir("test-")  # as root the private Postgres runs as nobody
    try:
        services = embedded.provide(directory, durable=False)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    early_config.stash[SERVICES] = (services, directory)
    os.environ.update(services.env)
    return (yield)


def pytest_report_header(config: pytest.Config) -> list[str]:
    if SERVICES not in config.stash:
        return []
    services, _ = config.stash[SERVICES]
    return [f"services: {'; '.join(services.reasons)}"]


def pytest_unconfigure(config: pytest.Config) -> None:
    if SERVICES not in config.stash:
        return
    services, directory = config.stash[SERVICES]
    # The session is over: receive tasks that its channel layers left on background loops would log a
    # traceback for the Redis that now goes away.
    logging.getLogger("channels_redis").setLevel(logging.CRITICAL)
    services.stop()
    shutil.rmtree(directory, ignore_errors=True)
