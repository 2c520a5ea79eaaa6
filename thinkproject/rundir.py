"""Directories and secrets of the private servers that `make run` and `make test` start.

A local user must not be able to plant what these servers run or read: every directory they use is
checked before it is used (this user's, a real directory, writable by nobody else), and their passwords
are random, kept in files only this user can read, and never put on a command line (which any local
user can read in /proc).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


class UnsafeDirectory(RuntimeError):
    """A directory someone else could write into (or swap for one of their own)."""


def private_dir(path: Path, *, mode: int = 0o700) -> Path:
    """`path`, made with `mode` if missing, and refused unless it is a directory (not a symbolic link)
    owned by this user that no other user may write into."""
    try:
        path.mkdir(mode=mode, parents=True)
    except FileExistsError:
        pass
    return checked_dir(path)


def checked_dir(path: Path) -> Path:
    """`path` as it is, refused unless this user's, a real directory, and writable by nobody else."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory of its own (a symbolic link or a file): remove it")
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(
            f"{path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()}): someone may have "
            "planted it; remove it, or point the private servers elsewhere"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(
            f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): chmod go-w it"
        )
    return path


def secret_in(path: Path, *, nbytes: int = 32) -> str:
    """The secret kept in `path` (mode 0600), made once; a process making it beside this one keeps
    the first (written whole, then linked into place)."""
    checked_dir(path.parent)
    if not path.exists():
        draft = path.with_name(f"{path.name}.{os.getpid()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(nbytes) + "\n")
        try:
            os.link(draft, path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise UnsafeDirectory(f"{path} must be this user's own file, readable by nobody else (chmod 600)")
    return path.read_text().strip()
