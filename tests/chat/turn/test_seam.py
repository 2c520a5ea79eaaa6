"""The seam of a continuation (chat.turn.seam): repeats a real model makes when asked to continue are
dropped, the rest joined with the whitespace the text needs, and nothing that is only maybe a repeat is
touched. Each case streams the continuation in small deltas, as a provider does."""

from __future__ import annotations

import pytest

from chat.turn.seam import RESTART_CHARS, Seam


def repaired(partial: str, continuation: str, *, size: int = 3) -> str:
    """The continuation as stored after the partial, fed `size` characters at a time."""
    seam = Seam(partial)
    out = [seam.feed(continuation[i : i + size]) for i in range(0, len(continuation), size)]
    return "".join(out) + seam.finish()


@pytest.mark.parametrize(
    ("partial", "continuation", "expected"),
    [
        # the last words repeated
        ("The cat sat on the", " on the mat.", " mat."),
        ("The cat sat on the", "sat on the mat.", " mat."),
        # the sentence restarted
        ("It was late. The train had not", " The train had not come yet.", " come yet."),
        # a sentence restarted after its first word
        ("It was late. Nobody", " Nobody came.", " came."),
        # a sentence repeated whole
        ("It was late. The train had not come.", " The train had not come. We waited.", " We waited."),
        # a list item restarted
        ("Fruit:\n1. Apples\n2. Bananas and", "2. Bananas and pears\n3. Plums", " pears\n3. Plums"),
        # a code line repeated
        ("def f(x):\n    total = x + 1\n", "    total = x + 1\n    return total\n", "    return total\n"),
        # the whole answer again, then more
        (
            "Once upon a time there was a robot",
            "Once upon a time there was a robot who painted.",
            " who painted.",
        ),
    ],
)
def test_a_repeat_is_dropped(partial: str, continuation: str, expected: str) -> None:
    assert repaired(partial, continuation) == expected
    assert repaired(partial, continuation, size=1) == expected
    assert repaired(partial, continuation, size=100) == expected


@pytest.mark.parametrize(
    ("partial", "continuation", "expected"),
    [
        # a clean continuation, released at once
        ("The cat sat on the", " mat.", " mat."),
        # glued on: a new sentence gets its space
        ("to assist artists by providing", "The AI, a robot", " The AI, a robot"),
        ("It was late.", "Then it rained.", " Then it rained."),
        # the middle of a word goes on without one
        ("The ca", "t sat.", "t sat."),
        ("providing", "ing them", "ing them"),
        # one word inside a sentence is not surely a repeat ("had had" is English)
        ("I have a", " a dog.", " a dog."),
        ("By then she had", " had enough.", " had enough."),
        # a restart that says something else is kept (with the space a glued sentence needs)
        (
            "Once upon a time there was a robot",
            "Once upon a time there lived a painter.",
            " Once upon a time there lived a painter.",
        ),
    ],
)
def test_what_is_not_surely_a_repeat_is_kept(partial: str, continuation: str, expected: str) -> None:
    assert repaired(partial, continuation) == expected


def test_a_clean_continuation_is_released_at_its_first_word() -> None:
    seam = Seam("The cat sat on the")
    assert seam.feed(" mat") == " mat"
    assert seam.feed(", purring.") == ", purring."


def test_the_partials_trailing_space_is_not_doubled() -> None:
    assert repaired("The cat sat on the ", "on the mat.") == "mat."
    assert repaired("The cat sat on the ", " mat.") == " mat."


def test_a_long_partial_is_not_held_back_for_a_restart() -> None:
    partial = "word " * (RESTART_CHARS // 5 + 10)
    seam = Seam(partial + "end")
    assert seam.feed("Something new") == " Something new"


def test_what_the_repair_dropped_is_known() -> None:
    seam = Seam("The cat sat on the")
    seam.feed(" on the mat.")
    assert seam.finish() == "" and seam.dropped == "on the"
