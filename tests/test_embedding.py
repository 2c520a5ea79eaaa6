"""The apps in a host site (tests/hostsite): its migrations and checks, and a page that follows its mount.

The host site runs in subprocesses with its own settings; this process keeps tests/settings.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client
from django.urls import include, path, reverse

ROOT = Path(__file__).resolve().parent.parent

# The URLconf of test_the_page_derives_its_urls_from_its_mount (pytest.mark.urls).
urlpatterns = [path("support/", include("chat.urls"))]


def manage(*args: str) -> subprocess.CompletedProcess[str]:
    # The host's own settings and database, not the ones of this pytest process.
    env = {
        k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "THINK_TEST_DATABASE_NAME")
    }
    return subprocess.run(
        [sys.executable, "manage.py", *args, "--settings=tests.hostsite.settings"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_host_site_migrations_are_complete() -> None:
    """A custom user model and another DEFAULT_AUTO_FIELD make no migration of the apps necessary.

    The host's database (`thinkhost`) need not exist: makemigrations only warns that it could not check
    the applied history."""
    result = manage("makemigrations", "--check", "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No changes detected" in result.stdout


def test_host_site_passes_the_system_checks() -> None:
    """Including the apps' admin classes, without django_stubs_ext's run-time patches."""
    result = manage("check", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stdout + result.stderr


def page_mount(html: str) -> str:
    match = re.search(r'<script id="think-mount" type="application/json">(.*?)</script>', html)
    assert match is not None, html
    return json.loads(match.group(1))  # type: ignore[no-any-return]


@pytest.mark.django_db  # the page gives an anonymous visitor a session (SessionAccess)
@pytest.mark.urls(__name__)
def test_the_page_derives_its_urls_from_its_mount(client: Client) -> None:
    response = client.get("/support/")
    assert response.status_code == 200
    mount = page_mount(response.content.decode())
    assert mount == "/support/"
    # The page fetches f"{mount}agents/{agent}/{name}/get-messages" and opens a socket on the same path.
    assert (
        reverse("think_chat:get-messages", kwargs={"agent": "a", "name": "n"})
        == f"{mount}agents/a/n/get-messages"
    )


@pytest.mark.django_db
def test_the_demo_page_is_mounted_at_the_root(client: Client) -> None:
    assert page_mount(client.get("/").content.decode()) == "/"
