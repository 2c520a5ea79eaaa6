"""The wheel ships the reusable apps and nothing of the demo site, the tests or the benchmarks.

It is built from a copy of the repository (so the working tree gets no build/ directory) with the
venv's setuptools and no network: `pip wheel --no-deps --no-build-isolation --no-index`.
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from email.message import Message
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
APPS = ("chat", "recovery")
NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv",
    "node_modules",
    "__pycache__",
    "*.pyc",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    "build",
    "dist",
    "*.egg-info",
    "staticfiles",
    ".run",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    setuptools = tuple(int(part) for part in version("setuptools").split(".")[:2])
    if setuptools < (77, 0):
        pytest.fail(f"setuptools {version('setuptools')} is too old to build the wheel: run `make install`")
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index"]
        + ["-w", str(tmp / "dist"), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = (tmp / "dist").glob("*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def names(wheel: zipfile.ZipFile) -> set[str]:
    return {name for name in wheel.namelist() if not name.endswith("/")}


def metadata(wheel: zipfile.ZipFile) -> Message:
    (path,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(path))


def test_the_wheel_holds_only_the_apps_and_the_scripted_model(wheel: zipfile.ZipFile) -> None:
    top = {name.split("/", 1)[0] for name in names(wheel)}
    assert {t for t in top if not t.endswith(".dist-info")} == {*APPS, "think_scripted"}
    for absent in ("thinkproject/", "tests/", "bench/", "docs/", "manage.py", "Procfile"):
        assert not [n for n in names(wheel) if n.startswith(absent)], absent


def test_every_file_of_the_apps_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    """Modules, migrations, management commands, templates, static files and py.typed, all of them."""
    sources = {
        path.relative_to(ROOT).as_posix()
        for app in APPS
        for path in (ROOT / app).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert sources - names(wheel) == set()
    for required in (
        "chat/py.typed",
        "recovery/py.typed",
        "chat/templates/chat/index.html",
        "chat/static/chat/app.js",
        "chat/static/chat/page.js",
        "chat/static/chat/client/state.js",
        "chat/static/chat/client/folding.js",
        "chat/static/chat/client/frames.js",
        "chat/static/chat/client/socket.js",
        "chat/static/chat/client/actions.js",
        "chat/static/chat/client/util.js",
        "chat/static/chat/app.css",
        "chat/migrations/0001_initial.py",
        "recovery/migrations/0001_initial.py",
        "recovery/management/commands/think_sweep.py",
        "chat/routing.py",
        "recovery/engine/schedules.py",
    ):
        assert required in names(wheel), required
    assert not [n for n in names(wheel) if n.endswith((".pyc", "asgi.py", "celery.py"))]


def test_dependencies_are_the_core_and_the_server_is_an_extra(wheel: zipfile.ZipFile) -> None:
    meta = metadata(wheel)
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    core = {canonicalize_name(r.name) for r in requires if r.marker is None}
    assert core == {
        "django",
        "channels",
        "channels-redis",
        "celery",
        "psycopg",
        "litellm",
        "prometheus-client",
        "pydantic",
    }
    assert set(meta.get_all("Provides-Extra") or []) == {"server", "scripted", "demo", "otel", "mcp", "dev"}
    assert extra(requires, "server") == {"daphne"}
    # Tracing is optional, and the apps need only the API of it (the site picks an SDK and an exporter).
    assert extra(requires, "otel") == {"opentelemetry-api"}
    # MCP servers' tools too: the SDK is imported only by a turn of an agent that names servers.
    assert extra(requires, "mcp") == {"mcp"}


def test_the_scripted_model_is_an_installable_command(wheel: zipfile.ZipFile) -> None:
    """A host site without a provider key runs `think-scripted-model` (extra `scripted`: aiohttp)."""
    (path,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "think-scripted-model = think_scripted.server:main" in wheel.read(path).decode()
    assert {"think_scripted/server.py", "think_scripted/dialects.py", "think_scripted/kwargs.py"} <= names(
        wheel
    )
    requires = [Requirement(r) for r in metadata(wheel).get_all("Requires-Dist") or []]
    assert extra(requires, "scripted") == {"aiohttp"}


def extra(requires: list[Requirement], name: str) -> set[str]:
    """The distributions an extra adds."""
    return {canonicalize_name(r.name) for r in requires if r.marker and r.marker.evaluate({"extra": name})}
