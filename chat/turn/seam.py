"""The seam of a continuation: where a recovered answer's new text meets the partial it continues.

Real models asked to continue do not always pick up where they stopped: they repeat the last words, restart
the sentence (or the list item, or the code line) they were in, or start the whole answer over. A
`Seam` holds the first text of a continuation back only as long as it could still be such a repeat, then
drops the repeated part and joins the rest with the whitespace the text needs:

- an overlap: the partial ends with what the continuation begins with (at least `MIN_OVERLAP_WORDS`
  words, or `MIN_OVERLAP_CHARS` characters of a single word, or one word that begins a sentence or a
  line, within the last `WINDOW_CHARS` characters of the partial, on word boundaries);
- a restart: the continuation begins with the whole partial again (when the partial is at most
  `RESTART_CHARS` long); a restart that says something else is left as it is.

It is conservative: text that only might be a repeat (one common word, a piece of a word) is kept, and a
continuation that cannot be a repeat is released at its first word, so a clean seam costs no latency.
"""

from __future__ import annotations

import re

WINDOW_CHARS = 600  # how far back in the partial an overlap may start
MIN_OVERLAP_WORDS = 2
MIN_OVERLAP_CHARS = 12
RESTART_CHARS = 4_000  # a restart of a longer partial is not looked for (nor held back for)
_WORD_CHAR = re.compile(r"\w")


class Seam:
    """Feed it the continuation's text deltas in order; it returns what may be sent now ("" while it
    holds the text back). `finish()` returns what it still holds, repaired, when the text ends."""

    def __init__(self, partial: str) -> None:
        self.spaced = partial[-1:].isspace()  # the partial already ends with the space the seam needs
        self.partial = partial.rstrip()
        window_start = max(0, len(self.partial) - WINDOW_CHARS)
        # where an overlap may begin: the starts of the words in the partial's last WINDOW_CHARS
        self.starts = [
            i
            for i in range(window_start, len(self.partial))
            if not self.partial[i].isspace() and (i == 0 or self.partial[i - 1].isspace())
        ]
        self.held = ""
        self.decided = not self.partial
        self.dropped = ""  # what the repair dropped, for the diagnostics event

    def feed(self, text: str) -> str:
        if self.decided:
            return text
        self.held += text
        opening = self.held.lstrip()
        if not opening or self._still_possible(opening):
            return ""
        return self._release()

    def finish(self) -> str:
        if self.decided:
            return ""
        return self._release()

    # -- deciding ------------------------------------------------------------------------------------------
    def _still_possible(self, opening: str) -> bool:
        """Whether more text could still make `opening` a repeat: it is a prefix of the partial (a
        restart) or of one of its suffixes in the window (an overlap growing)."""
        if len(self.partial) <= RESTART_CHARS and len(opening) <= len(self.partial):
            if self.partial.startswith(opening):
                return True
        return any(self.partial.startswith(opening, start) for start in self.starts)

    def _release(self) -> str:
        self.decided = True
        held, self.held = self.held, ""
        opening = held.lstrip()
        drop = self._repeat_length(opening)
        self.dropped = opening[:drop]
        rest = opening[drop:] if drop else held
        if self.spaced:  # the partial's own trailing space or line break stands for the rest's
            return rest[1:] if drop and rest.startswith("\n") else rest.lstrip(" ") if drop else rest
        return _join(self.partial, rest, repaired=bool(drop))

    def _repeat_length(self, opening: str) -> int:
        """How many characters of `opening` repeat the partial (0: none, or not surely)."""
        whole = self.partial
        if len(whole) <= RESTART_CHARS and opening.startswith(whole) and _boundary(opening, len(whole)):
            return len(whole)  # the whole answer again, then more
        best = 0
        for start in self.starts:
            overlap = self.partial[start:]
            sure = _sure(overlap) or _starts_sentence(self.partial, start)
            if opening.startswith(overlap) and _boundary(opening, len(overlap)) and sure:
                best = max(best, len(overlap))
        return best


def _boundary(text: str, index: int) -> bool:
    """`index` is not inside a word of `text`."""
    return index >= len(text) or not (_WORD_CHAR.match(text[index]) and _WORD_CHAR.match(text[index - 1]))


def _starts_sentence(text: str, start: int) -> bool:
    """The word at `start` begins a sentence or a line: one word of it again is the sentence restarted."""
    before = text[:start].rstrip(" \t")
    return not before or before.endswith(("\n", ".", "!", "?"))


def _sure(overlap: str) -> bool:
    words = overlap.split()
    return len(words) >= MIN_OVERLAP_WORDS or len(overlap) >= MIN_OVERLAP_CHARS


def _join(partial: str, rest: str, *, repaired: bool) -> str:
    """`rest` as it follows the partial: after a dropped repeat, with the one space (or line break) the
    repeat's end had; glued on without any, with a space where a new sentence or word plainly starts."""
    if repaired:
        if rest[:1].isspace() or not rest or not partial:
            return rest
        return rest if not _WORD_CHAR.match(rest[0]) else " " + rest
    if not rest or rest[:1].isspace() or not partial:
        return rest
    last, first = partial[-1], rest[0]
    if last in ".!?;:," and (first.isalnum() or first in "\"'(["):
        return " " + rest
    if (last.isalnum() or last in ")]\"'") and first.isupper() and not last.isupper():
        return " " + rest
    return rest
