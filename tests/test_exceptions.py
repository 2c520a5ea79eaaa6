"""Each app raises its exceptions from one module, under one base class, keeping the built-in bases
its callers catch."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import chat.exceptions
import recovery.exceptions
from chat.exceptions import ThinkError
from recovery.exceptions import RecoveryError

ROOT = Path(__file__).resolve().parents[1]


def public_classes(module: object) -> list[type[BaseException]]:
    return [
        cls
        for name, cls in vars(module).items()
        if inspect.isclass(cls)
        and issubclass(cls, BaseException)
        and not name.startswith("_")
        and cls.__module__ == module.__name__  # type: ignore[attr-defined]
    ]


@pytest.mark.parametrize(
    ("module", "base"), [(chat.exceptions, ThinkError), (recovery.exceptions, RecoveryError)]
)
def test_every_exception_of_an_app_has_its_base(module: object, base: type[BaseException]) -> None:
    classes = public_classes(module)
    assert len(classes) > 2
    assert all(issubclass(cls, base) for cls in classes)


def test_the_built_in_bases_callers_catch_are_kept() -> None:
    assert issubclass(chat.exceptions.ProtocolError, ValueError)
    assert issubclass(chat.exceptions.LimitExceeded, chat.exceptions.ProtocolError)
    assert issubclass(chat.exceptions.UnknownAgent, LookupError)
    assert issubclass(chat.exceptions.SubmissionNotFound, LookupError)
    assert issubclass(chat.exceptions.SubmissionConflict, ValueError)
    assert issubclass(chat.exceptions.ConversationBusy, TimeoutError)


def test_the_old_import_paths_name_the_same_classes() -> None:
    from chat.access import AccessDenied
    from chat.protocol import ProtocolError
    from recovery.lease.fibers import LeaseLost

    assert AccessDenied is chat.exceptions.AccessDenied
    assert ProtocolError is chat.exceptions.ProtocolError
    assert LeaseLost is recovery.exceptions.LeaseLost


@pytest.mark.parametrize("app", ["chat", "recovery"])
def test_no_other_module_of_the_app_defines_a_public_exception(app: str) -> None:
    """An exception class outside exceptions.py (a private one, `_Name`, for a module's own control
    flow, excepted) is a second owner."""
    found = []
    for path in sorted((ROOT / app).rglob("*.py")):
        if path.name == "exceptions.py" or "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & {"Exception", "ValueError", "LookupError", "TimeoutError", "RuntimeError"}:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert found == []
