"""Every `manage.py check` id the apps emit has one meaning (one check function emits it), and README's
table ("What `manage.py check` refuses") lists exactly the ids the code has."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ID = re.compile(r"think_(?:chat|recovery)\.[EWI]\d{3}")
BARE = re.compile(r"[EW]\d{3}")  # chat.turn.agent_checks gives the number; its caller adds "think_chat."


def sources() -> list[Path]:
    return [
        p for app in ("chat", "recovery") for p in (ROOT / app).rglob("*.py") if "migrations" not in p.parts
    ]


def emitted() -> dict[str, set[str]]:
    """id -> the functions that emit it: an `id=` of a check message, or the id of an agent-class check."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sources():
        tree = ast.parse(path.read_text())
        for function in (n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)):
            where = f"{path.relative_to(ROOT)}:{function.name}"
            for node in ast.walk(function):
                values: list[ast.expr] = []
                if isinstance(node, ast.Call):
                    values = [k.value for k in node.keywords if k.arg == "id"]
                elif isinstance(node, ast.Tuple) and path.name == "agent_checks.py":
                    values = list(node.elts)
                for value in values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        text = value.value
                        if BARE.fullmatch(text):
                            text = f"think_chat.{text}"
                        if ID.fullmatch(text):
                            found[text].add(where)
    return found


def readme_ids() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("### What `manage.py check` refuses", 1)[1].split("\n### ", 1)[0]
    chat, recovery = section.split("`think_recovery`:", 1)
    rows = re.compile(r"^\| ([EWI]\d{3}) \|", re.MULTILINE)
    return {f"think_chat.{i}" for i in rows.findall(chat)} | {
        f"think_recovery.{i}" for i in rows.findall(recovery)
    }


def test_each_id_is_emitted_by_one_check() -> None:
    assert len(emitted()) == 44, "the scan finds every id"
    shared = {name: places for name, places in emitted().items() if len(places) > 1}
    assert shared == {}, "an id emitted by two checks means two things"


def test_the_readme_lists_exactly_the_ids_of_the_code() -> None:
    in_code = set(emitted())
    mentioned = {m for p in sources() for m in ID.findall(p.read_text())}  # messages and docstrings too
    assert readme_ids() == in_code | mentioned
