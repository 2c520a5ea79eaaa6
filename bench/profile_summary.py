"""Where a process's time went, from py-spy's collapsed stacks (`py-spy record --format raw`).

Each sample is charged to the innermost frame that belongs to a known part (the ASGI server, Channels,
the channel layer and its Redis client, msgpack, JSON, this project's apps, Django, asyncio), so a
part's share counts the library code it calls that belongs to no other part. Also lists the innermost
frames (functions) with the most samples.

    .venv/bin/python bench/profile_summary.py /tmp/web.ws-200x100.txt
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

# (part, what a frame's "function (file:line)" contains), first match from the innermost frame wins.
PARTS = (
    ("postgres client (psycopg)", ("psycopg",)),
    ("json", ("/json/",)),
    ("msgpack", ("msgpack",)),
    ("channel layer (channels_redis, redis)", ("channels_redis", "/redis/")),
    ("channels (consumers, routing)", ("/channels/",)),
    ("this project (chat, recovery)", ("/chat/", "/recovery/", "(chat/", "(recovery/")),
    ("daphne", ("/daphne/",)),
    ("twisted", ("/twisted/",)),
    ("autobahn", ("/autobahn/",)),
    ("uvicorn", ("/uvicorn/",)),
    ("websockets", ("/websockets/",)),
    ("django", ("/django/",)),
    ("asgiref", ("/asgiref/",)),
    ("asyncio", ("/asyncio/",)),
)


def read(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stacks.append((frames.split(";"), int(count)))
    return stacks


def part_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for part, needles in PARTS:
            if any(n in frame for n in needles):
                return part
    return "other"


def summary(path: Path, top: int = 15) -> str:
    stacks = read(path)
    total = sum(c for _, c in stacks)
    if not total:
        return f"  {path}: no samples"
    parts: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for frames, count in stacks:
        parts[part_of(frames)] += count
        leaves[frames[-1]] += count
    # py-spy leaves out the samples of an idle process (waiting in epoll): these are its busy ones.
    lines = [f"  {total} busy samples; by part (the innermost frame of a known part):"]
    lines += [f"    {count / total:6.1%}  {part}" for part, count in parts.most_common()]
    threads = sum(c for frames, c in stacks if frames[0].startswith("Thread._bootstrap"))
    lines.append(f"  {threads / total:.0%} of the samples in threads (sync_to_async, database_sync_to_async)")
    lines.append("  innermost frames:")
    lines += [f"    {count / total:6.1%}  {frame[:150]}" for frame, count in leaves.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(name)
        print(summary(Path(name)))
