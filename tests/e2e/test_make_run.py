"""README's run command on a machine whose Postgres and Redis are out of reach: `make run` starts
private ones under .run/, serves the page, streams a turn, and leaves nothing running when stopped;
the next `make run` finds the conversation in .run/pgdata.

It runs in a fresh `git clone` of this repository's committed HEAD, with no DATABASE_URL or
REDIS_URL and the default ports pointed at ports where nothing listens
(THINK_DEFAULT_PG_PORT, THINK_DEFAULT_REDIS_PORT): the shared servers on 5432 and 6379 stay up and
untouched. The clone's .venv is a link to this checkout's, so `make run` is given
`-o .venv/.installed` (no reinstall: a minute of pip, and it would move the editable install to the
clone); everything after the install is the README's command as it stands.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis
from django.conf import settings

from tests.support import (
    ROOT,
    ChatClient,
    ConversationLog,
    assistant_text,
    chat_request,
    follow_conversation,
    free_port,
    http_get,
    numbers,
    user_message,
    wait_until,
)
from thinkproject.embedded import answers

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

VENV = Path(sys.executable).parent.parent
# Whatever points the stack somewhere is dropped: the clone must find its services by itself.
DROPPED = ("DJANGO_", "THINK_", "CELERY_", "CHANNELS_", "SCRIPTED_", "PROMETHEUS_", "MAKE", "MFLAGS")


class MakeRun:
    """`make run -o .venv/.installed` in the clone, in a session of its own (its process group is
    what a terminal's Ctrl-C reaches)."""

    def __init__(self, clone: Path, env: dict[str, str], log: Path) -> None:
        self.clone, self.env, self.log_path = clone, env, log
        self.web_port = int(env["WEB_PORT"])
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                ["make", "run", "-o", ".venv/.installed"],
                cwd=self.clone,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_until(self.healthy, 180, f"make run to serve (log {self.log_path})", interval=0.5)

    def healthy(self) -> bool:
        assert self.popen is not None
        assert self.popen.poll() is None, self.log()
        try:
            return http_get(self.web_port, "/healthz")[0] == 200
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 60) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def services(self) -> dict[str, str]:
        lines = (self.clone / ".run" / "services.env").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines)

    def postmaster_pid(self) -> int:
        return int((self.clone / ".run" / "pgdata" / "postmaster.pid").read_text().split()[0])


def port_of(url: str) -> int:
    port = urlparse(url).port
    assert port is not None, url
    return port


def processes_in(directory: Path) -> list[str]:
    """Processes whose working directory or command line is inside `directory`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cwd.startswith(str(directory)) or str(directory) in cmdline:
            found.append(f"{proc.name} (cwd {cwd}): {cmdline[:200]}")
    return found


@pytest.fixture(scope="module")
def clone() -> Path:
    # Not under pytest's tmp dir: as root the private Postgres runs as nobody, who must reach .run/.
    path = Path(tempfile.mkdtemp(prefix="think-clone-")) / "thinkproject"
    path.parent.chmod(0o755)
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(path)], check=True, timeout=120)
    (path / ".venv").symlink_to(VENV)
    return path


@pytest.fixture(scope="module")
def make_run(clone: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MakeRun]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED)}
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    model_port = free_port()
    env.update(
        THINK_DEFAULT_PG_PORT=str(free_port()),
        THINK_DEFAULT_REDIS_PORT=str(free_port()),
        WEB_PORT=str(free_port()),
        SCRIPTED_MODEL_PORT=str(model_port),
        SCRIPTED_MODEL_URL=f"http://127.0.0.1:{model_port}/v1",
        DJANGO_SECRET_KEY=settings.SECRET_KEY,  # the test clients' tokens are signed with the tests' key
        WORKER_CONCURRENCY="8",
        BEAT_SCHEDULE_FILE=str(clone / ".run" / "beat-schedule"),
    )
    run = MakeRun(clone, env, tmp_path_factory.mktemp("make-run") / "make-run.log")
    try:
        yield run
    finally:
        if run.popen is not None and run.popen.poll() is None:
            os.killpg(run.popen.pid, signal.SIGINT)
            run.wait()
        shutil.rmtree(clone.parent, ignore_errors=True)


async def chat(port: int, name: str, text: str) -> ConversationLog:
    async with ChatClient(port, name) as client:
        await client.send(chat_request(uuid.uuid4().hex[:10], [user_message(text)]))
        return await follow_conversation(client, timeout=60)


async def stored(port: int, name: str) -> list[dict[str, object]]:
    """The transcript a client gets when it opens the conversation."""
    async with ChatClient(port, name) as client:
        frame = await client.recv_type("cf_agent_chat_messages", timeout=20)
        return list(frame["messages"])


def assert_stopped(run: MakeRun, postmaster: int, redis_port: int) -> None:
    assert not Path(f"/proc/{postmaster}").exists(), "the private Postgres was stopped"
    assert not answers(redis_port), "the private Redis was stopped"
    assert not (run.clone / ".run" / "services.env").exists()
    leftovers = processes_in(run.clone)
    assert not leftovers, "left running:\n" + "\n".join(leftovers)


def test_make_run_with_no_servers_starts_private_ones_streams_and_keeps_the_data(make_run: MakeRun) -> None:
    name = f"make-run-{uuid.uuid4().hex[:8]}"
    try:
        make_run.start()
        services = make_run.services()
        db_port, redis_port = port_of(services["DATABASE_URL"]), port_of(services["REDIS_URL"])
        assert db_port != int(make_run.env["THINK_DEFAULT_PG_PORT"]) and db_port != 5432
        assert (make_run.clone / ".run" / "pgdata" / "PG_VERSION").exists()
        postmaster = make_run.postmaster_pid()
        assert Path(f"/proc/{postmaster}").exists()
        assert redis.Redis.from_url(services["REDIS_URL"]).ping()
        assert http_get(make_run.web_port, "/")[0] == 200, "the page"

        log = asyncio.run(chat(make_run.web_port, name, "count to 40"))
        assert log.text == numbers(40), "streamed through the private servers"

        os.killpg(make_run.popen.pid, signal.SIGINT)  # type: ignore[union-attr]  # Ctrl-C
        make_run.wait()
        assert_stopped(make_run, postmaster, redis_port)

        make_run.start()  # again: the same data directory
        assert assistant_text(asyncio.run(stored(make_run.web_port, name))) == numbers(40)
        postmaster, redis_port = make_run.postmaster_pid(), port_of(make_run.services()["REDIS_URL"])
        make_run.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]  # to make alone
        make_run.wait()
        assert_stopped(make_run, postmaster, redis_port)
    except BaseException:
        print(make_run.log()[-20000:])
        raise
