"""A public or guessable SECRET_KEY is refused (issue 34, row 1).

The demo fell back to a development key and compose shipped `change-me`; `check --deploy` with DEBUG
off only warned. Whoever knows the key signs "user:1" with the token salt and opens user 1's
conversations. Now `manage.py check --deploy` fails on such a key (think_chat.E026), and with DEBUG off
no process starts with one: daphne, the worker, manage.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.core import signing

from chat.access import TOKEN_SALT
from chat.secret_key import secret_key_problem
from thinkproject.settings import development_secret_key

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
OLD_DEFAULT = "insecure-dev-key-change-me-in-production"  # thinkproject/settings.py's fallback until now
STRONG = "qX3v9-fR2mL8kZ1pT6wN4yB7hJ0cD5sG-aE2uI9oQ3rV8tY1xW6zM4nK7bP0lF5jH"
PUBLIC = [
    OLD_DEFAULT,
    "change-me",
    "django-insecure-" + "k" * 50 + "0123456789",
    "short-but-random-9f8e7d",
    "ab" * 40,
]


@pytest.mark.parametrize("key", PUBLIC + ["", "tests-only"])
def test_public_or_guessable_keys_are_unsafe(key: str) -> None:
    assert secret_key_problem(key) is not None


def test_a_long_random_key_is_safe() -> None:
    assert secret_key_problem(STRONG) is None


def demo(
    *args: str, debug: str | None, key: str | None, extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """A command of the demo site (thinkproject.settings) as a deployment runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "THINK_TEST"))}
    env["DJANGO_SETTINGS_MODULE"] = "thinkproject.settings"
    if debug is not None:
        env["DJANGO_DEBUG"] = debug
    if key is not None:
        env["DJANGO_SECRET_KEY"] = key
    env.update(extra or {})
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("key", [OLD_DEFAULT, "change-me", "tests-only"])
def test_check_deploy_fails_on_a_public_key_even_with_debug_on(key: str) -> None:
    result = demo(sys.executable, "manage.py", "check", "--deploy", debug="1", key=key)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "think_chat.E026" in result.stdout + result.stderr


def test_check_deploy_passes_the_key_rule_with_a_strong_key() -> None:
    result = demo(sys.executable, "manage.py", "check", "--deploy", debug="0", key=STRONG)
    assert "think_chat.E026" not in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize("key", [OLD_DEFAULT, "change-me", None])
def test_nothing_starts_with_debug_off_and_a_public_or_missing_key(key: str | None) -> None:
    """DEBUG is off unless asked for: the deployment that sets no key, or the compose placeholder, stops."""
    result = demo(sys.executable, "manage.py", "migrate", "--plan", debug=None, key=key)
    assert result.returncode != 0
    assert "think_chat.E026" in result.stderr
    worker = demo(sys.executable, "-c", "import django; django.setup()", debug="0", key=key)
    assert worker.returncode != 0 and "think_chat.E026" in worker.stderr


def test_daphne_refuses_to_serve_with_the_old_default_key() -> None:
    """The attack needs a running site that trusts the public key: a token signed with it for user 1."""
    forged = signing.dumps("user:1", key=OLD_DEFAULT, salt=TOKEN_SALT)
    assert forged  # what an outsider could make before; now no daphne takes the key to check it
    result = demo(
        str(BIN / "daphne"),
        "-b",
        "127.0.0.1",
        "-p",
        "0",
        "thinkproject.asgi:application",
        debug=None,
        key=OLD_DEFAULT,
    )
    assert result.returncode != 0
    assert "think_chat.E026" in result.stderr


def test_an_unsafe_fallback_key_is_refused_too() -> None:
    from django.test import override_settings

    from chat.checks import check_secret_key

    with override_settings(SECRET_KEY=STRONG, SECRET_KEY_FALLBACKS=["change-me"]):
        assert [m.id for m in check_secret_key()] == ["think_chat.E026"]
        assert "SECRET_KEY_FALLBACKS[0]" in check_secret_key()[0].msg
    with override_settings(SECRET_KEY=STRONG, SECRET_KEY_FALLBACKS=[]):
        assert check_secret_key() == []


def test_make_runs_own_key_is_random_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / ".run" / "secret_key"
    key = development_secret_key(path)
    assert secret_key_problem(key) is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert development_secret_key(path) == key
    assert development_secret_key(tmp_path / "other" / "secret_key") != key


def test_the_demo_settings_read_the_proxy_and_trusted_origins_from_the_environment() -> None:
    """Behind a TLS proxy the page's https:// origin must match its socket's (chat/origins.py)."""
    script = "from django.conf import settings as s; print(s.SECURE_PROXY_SSL_HEADER, s.CSRF_TRUSTED_ORIGINS)"
    plain = demo(sys.executable, "-c", script, debug="0", key=STRONG)
    assert plain.stdout.strip() == "None []", plain.stderr
    origins = "https://a.example,https://b.example:8443"
    extra = {"DJANGO_BEHIND_TLS_PROXY": "1", "DJANGO_CSRF_TRUSTED_ORIGINS": origins}
    proxied = demo(sys.executable, "-c", script, debug="0", key=STRONG, extra=extra)
    assert proxied.stdout.split() == ["('HTTP_X_FORWARDED_PROTO',", "'https')", *_listed(origins)], (
        proxied.stderr
    )


def _listed(origins: str) -> list[str]:
    return str(origins.split(",")).split()
