"""The apps' public faces (chat.api, recovery.api): every name they list resolves to the object its
module defines, the names a type checker sees are the same, they import before Django's apps are ready,
and chat.agents, kept for older imports, lists nothing that is not on the face."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import chat.agents

FACES = ("chat.api", "recovery.api")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("face", FACES)
def test_every_name_is_its_modules_own(face: str) -> None:
    module = importlib.import_module(face)
    table: dict[str, str] = module._FACE
    assert module.__all__ == sorted(table)
    for name, source in table.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name), name
    with pytest.raises(AttributeError, match="has no attribute 'agent_class'"):
        module.agent_class  # noqa: B018 - an internal name is not on the face
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize("face", FACES)
def test_a_type_checker_sees_the_same_names(face: str) -> None:
    """The face's `if TYPE_CHECKING:` imports are what mypy knows of it: the same names, from the same
    modules, as the table the face resolves at run time."""
    module = importlib.import_module(face)
    tree = ast.parse(inspect.getsource(module))
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {}
    for node in guarded.body:
        assert isinstance(node, ast.ImportFrom)
        assert node.level in (0, 1) and node.module
        absolute = f"{face.rsplit('.', 1)[0]}.{node.module}" if node.level else node.module
        for alias in node.names:
            seen[alias.name] = absolute
    assert seen == module._FACE


def test_the_faces_import_from_settings() -> None:
    """A site's settings read `beat_schedule` from recovery.api before any app is loaded."""
    code = (
        "import chat.api, recovery.api\n"
        "assert callable(recovery.api.beat_schedule)\n"
        "import sys\n"
        "assert 'chat.models' not in sys.modules and 'recovery.models' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_chat_agents_lists_only_public_names() -> None:
    assert set(chat.agents.__all__) <= set(importlib.import_module("chat.api").__all__)
    assert {"agent_class", "agent_for", "kebab"}.isdisjoint(chat.agents.__all__)
