"""CPU and memory of process trees, read from /proc (Linux): what each part of the stack spent.

A tree's CPU is, summed over its live processes, their own user + system time plus what their exited
children left them (cutime, cstime): every process that ever ran under the root is counted once, the
exited ones (a Postgres backend that closed, a pool child that was replaced) included.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces: split after its closing parenthesis.
    return raw[raw.rindex(")") + 2 :].split()


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def tree_pids(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    children = children if children is not None else _children()
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def cpu_seconds(pids: Iterable[int]) -> float:
    total = 0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:  # utime, stime, cutime, cstime are fields 14-17 (index 11-14 here)
            total += sum(int(x) for x in fields[11:15])
    return total / TICK


def rss_bytes(pids: Iterable[int]) -> int:
    total = 0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            total += int(fields[21]) * PAGE  # rss, in pages (field 24)
    return total


def pids_named(name: str) -> list[int]:
    """Processes whose command name is `name` (postgres, redis-server)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == name:
                        found.append(int(entry))
            except OSError:
                pass
    return found


@dataclass
class Part:
    """One part of the stack: how to find its processes now (they may come and go)."""

    name: str
    pids: Callable[[], list[int]]


def tree(root: int) -> Callable[[], list[int]]:
    return lambda: tree_pids(root)


def trees(roots: Callable[[], list[int]]) -> Callable[[], list[int]]:
    def pids() -> list[int]:
        children = _children()
        return [pid for root in roots() for pid in tree_pids(root, children)]

    return pids


def postgres_cluster() -> list[int]:
    """The postmaster (parent of every backend, live or exited) and its tree."""
    postgres = set(pids_named("postgres"))
    children = _children()
    roots = [pid for pid in postgres if int((_stat(pid) or ["", "0"])[1]) not in postgres]
    return [pid for root in roots for pid in tree_pids(root, children)]


class Meter:
    """CPU seconds of each part between `start()` and `stop()`."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self._start: dict[str, float] = {}
        self.spent: dict[str, float] = {}

    def sample(self) -> dict[str, float]:
        return {part.name: cpu_seconds(part.pids()) for part in self.parts}

    def start(self) -> None:
        self._start = self.sample()

    def stop(self) -> dict[str, float]:
        now = self.sample()
        self.spent = {name: now[name] - self._start.get(name, 0.0) for name in now}
        return self.spent
