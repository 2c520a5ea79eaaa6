"""docker-compose.yml cannot run here (no Docker engine), so its structure is checked instead."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.urls import resolve

from recovery.operations.health import healthz

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def procfile() -> dict[str, str]:
    entries = (line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines() if line.strip())
    return {name.strip(): command.strip() for name, command in entries}


def test_has_every_service(compose: dict[str, Any]) -> None:
    assert {"postgres", "redis", "migrate", "web", "worker", "beat", "model"} <= set(compose["services"])


@pytest.mark.parametrize("service", ["postgres", "redis", "redis-channels", "web", "worker", "model"])
def test_long_running_services_have_health_checks(compose: dict[str, Any], service: str) -> None:
    check = compose["services"][service]["healthcheck"]
    assert check["test"] and check["interval"] and check["retries"] > 0


@pytest.mark.parametrize("service", ["web", "worker", "beat"])
def test_app_services_wait_for_healthy_dependencies_and_migrations(
    compose: dict[str, Any], service: str
) -> None:
    depends = compose["services"][service]["depends_on"]
    assert depends["postgres"]["condition"] == "service_healthy"
    assert depends["redis"]["condition"] == "service_healthy"
    assert depends["migrate"]["condition"] == "service_completed_successfully"


def test_app_services_share_the_environment(compose: dict[str, Any]) -> None:
    for service in ("migrate", "web", "worker", "beat", "model"):
        env = compose["services"][service]["environment"]
        assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
        assert env["DATABASE_URL"].startswith("postgres://")
        assert env["SCRIPTED_MODEL_URL"] == "http://model:8765/v1"


def test_broker_redis_never_evicts_and_persists(compose: dict[str, Any]) -> None:
    command = compose["services"]["redis"]["command"]
    assert "--maxmemory-policy noeviction" in command and "--appendonly yes" in command


def test_web_health_check_uses_the_health_endpoint(compose: dict[str, Any]) -> None:
    web = compose["services"]["web"]
    check = " ".join(web["healthcheck"]["test"])
    match = re.search(r"urlopen\('http://127\.0\.0\.1:(\d+)(/[^']*)'", check)
    assert match is not None, check
    port, path = match.groups()
    assert f"-p {port} " in web["command"]  # the port daphne listens on
    assert resolve(path).func is healthz  # the Postgres, Redis and beat checks, 503 when one fails


def test_web_worker_and_beat_share_one_metrics_directory(compose: dict[str, Any]) -> None:
    """prometheus_client multiprocess mode: every process writes there and web serves /metrics."""
    services = compose["services"]
    directory = services["web"]["environment"]["PROMETHEUS_MULTIPROC_DIR"]
    for name in ("migrate", "web", "worker", "beat"):
        assert services[name]["environment"]["PROMETHEUS_MULTIPROC_DIR"] == directory
        assert f"metrics:{directory}" in services[name]["volumes"]
    assert "metrics" in compose["volumes"]
    # Emptied once per start, before web, worker and beat (which wait for migrate to complete).
    assert "thinkproject.bootstrap metrics" in services["migrate"]["command"]


def test_compose_runs_what_the_procfile_runs(compose: dict[str, Any]) -> None:
    """The same worker pool and daphne flags in development and in containers."""
    processes = procfile()
    assert set(processes) == {"web", "worker", "beat", "model"}
    worker = compose["services"]["worker"]["command"]
    assert "--pool threads" in worker and "--pool threads" in processes["worker"]
    for flag in ("--websocket_timeout 86400", "--ping-interval 20", "thinkproject.asgi:application"):
        assert flag in compose["services"]["web"]["command"] and flag in processes["web"]


def test_procfile_processes_share_the_metrics_directory_make_run_empties() -> None:
    processes = procfile()
    for name in ("web", "worker", "beat"):
        assert "PROMETHEUS_MULTIPROC_DIR=${PROMETHEUS_MULTIPROC_DIR:-.run/metrics}" in processes[name]
    makefile = (ROOT / "Makefile").read_text()
    assert "run: export PROMETHEUS_MULTIPROC_DIR ?= $(CURDIR)/.run/metrics" in makefile
    assert "thinkproject.bootstrap metrics" in makefile


def test_single_beat(compose: dict[str, Any]) -> None:
    assert compose["services"]["beat"].get("deploy", {}).get("replicas", 1) == 1


def test_no_key_ships_with_the_stack(compose: dict[str, Any]) -> None:
    """Issue 34 row 1: compose shipped `change-me`, a key anyone could sign a token for user 1 with.
    `${VAR:?message}` makes compose stop until the key is set."""
    for service in ("migrate", "web", "worker", "beat"):
        key = compose["services"][service]["environment"]["DJANGO_SECRET_KEY"]
        assert key.startswith("${DJANGO_SECRET_KEY:?"), key
        assert compose["services"][service]["environment"]["DJANGO_DEBUG"] == "False"


def test_the_web_port_is_published_on_this_machine_only_and_needs_a_login(compose: dict[str, Any]) -> None:
    """Issue 34 row 7: port 8000 was published on every interface, open to anonymous visitors."""
    for service in compose["services"].values():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), port
    env = compose["services"]["web"]["environment"]
    assert env["THINK_ACCESS_POLICY"] == "${THINK_ACCESS_POLICY:-chat.access.UserAccess}"
