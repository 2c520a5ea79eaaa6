"""The seam of a continuation, measured: how many recovered answers hold a repeated span, without and with
the seam repair (chat.turn.seam), under each habit of the scripted model's continuations.

Per habit, `--rounds` recoveries of the scripted model's story (`[story]`), each cut off after a random
number of words (3 to all but 3): the continuation is what the scripted model answers to that partial
(its own reply planner, think_scripted.server.plan_reply, as for a real request: the partial as the last
assistant message, then the continue instruction), streamed into the seam word by word as the turn's
loop does. An answer "holds a repeated span" when some run of three words appears in it more often than
in the story. Without the seam the continuation is appended as it comes; with it, as the seam releases
it. Habits: none (a model that obeys), `[repeat N]` (N from 1 to 8 at random), `[restart]` (the sentence),
`[restart all]` (the whole answer, glued on). It asserts nothing.

The in-process recovery of the same story under each habit, through the runner, the engine and the alarm,
is tests/chat/turn/test_seam_recovery.py; this counts, that proves the path.

    .venv/bin/python bench/seam.py --rounds 50 --seed 7
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chat.turn.seam import Seam  # noqa: E402
from think_scripted.server import CONTINUE_PREFIX, STORY, plan_reply  # noqa: E402

HABITS = ("none", "repeat", "restart", "restart all")


def trigrams(text: str) -> Counter[tuple[str, ...]]:
    words = text.split()
    return Counter(tuple(words[i : i + 3]) for i in range(len(words) - 2))


STORY_TRIGRAMS = trigrams(STORY)


def repeated(text: str) -> bool:
    return any(count > STORY_TRIGRAMS.get(gram, 0) for gram, count in trigrams(text).items())


def continuation(prompt: str, partial: str) -> list[str]:
    messages = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": partial},
        {"role": "user", "content": f"{CONTINUE_PREFIX} from exactly where it left off."},
    ]
    return [str(delta["content"]) for delta in plan_reply(messages).deltas]


def one(habit: str, rng: random.Random) -> tuple[bool, bool, bool]:
    """(repeated without the seam, repeated with it, the answer exactly the story with it)."""
    directive = {"none": "", "repeat": f"[repeat {rng.randint(1, 8)}]", "restart": "[restart]"}.get(
        habit, "[restart all]"
    )
    words = STORY.split()
    cut = rng.randint(3, len(words) - 3)
    partial = " ".join(words[:cut])
    deltas = continuation(f"[story] {directive}", partial)
    naive = partial + "".join(deltas)
    seam = Seam(partial)
    repaired = partial + "".join(seam.feed(delta) for delta in deltas) + seam.finish()
    return repeated(naive), repeated(repaired), repaired == STORY


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(
        f"{args.rounds} recoveries per habit of the scripted story, cut at a random word (seed {args.seed})"
    )
    print(f"{'habit':<12} {'repeated, no seam':>18} {'repeated, seam':>15} {'exact, seam':>12}")
    for habit in HABITS:
        results = [one(habit, rng) for _ in range(args.rounds)]
        before = sum(r[0] for r in results)
        after = sum(r[1] for r in results)
        exact = sum(r[2] for r in results)
        print(
            f"{habit:<12} {before:>14} / {args.rounds:<2} {after:>11} / {args.rounds:<2}"
            f" {exact:>8} / {args.rounds}"
        )


if __name__ == "__main__":
    main()
