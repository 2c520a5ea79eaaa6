"""Argument types shared by the recovery commands: each rejects a bad value with a clear message."""

from __future__ import annotations

import argparse
import math
import uuid


def non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be a finite number, zero or more")
    return number


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1")
    return number


def fiber_id(value: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a fiber id (a UUID)") from None


def agent_and_name(value: str) -> tuple[str, str]:
    agent, _, name = value.partition("/")
    if not agent or not name:
        raise argparse.ArgumentTypeError(f"{value!r} is not AGENT/NAME (for example assistant/support-42)")
    return agent, name
