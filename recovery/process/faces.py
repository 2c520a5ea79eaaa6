"""An app's public face as a module of names imported when first used (PEP 562), so that the face can
be imported from settings, before Django's apps are ready (chat.api, recovery.api)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_face(module: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of the face `module`, whose `names` map each public name to the
    module that defines it."""

    def attribute(name: str) -> Any:
        source = names.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module], name, value)  # once: the next lookup finds it without this function
        return value

    def names_of() -> list[str]:
        return sorted({*vars(sys.modules[module]), *names})

    return attribute, names_of
