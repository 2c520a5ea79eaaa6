"""Transcript integrity: repairing tool calls an interruption left without a result.

Every model call starts from a repaired transcript: a tool part with a call id that is neither settled
nor approved becomes an `output-error` part (or whatever the agent's override returns), and every tool
part's input is normalised to an object. Parts are never deleted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..types import Part, UIMessage
from .folding import SETTLED_TOOL_STATES, is_tool_part, tool_name_of

INTERRUPTED_TOOL_ERROR = "The tool call was interrupted before a result was recorded."


def normalize_input(value: Any) -> dict[str, Any]:
    """An object stays; a string holding a JSON object becomes it; anything else becomes {}."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def is_repairable(part: Part) -> bool:
    return is_tool_part(part) and isinstance(part.get("toolCallId"), str)


def is_settled(part: Part) -> bool:
    return "output" in part or "result" in part or part.get("state") in SETTLED_TOOL_STATES


def default_repair(part: Part) -> Part:
    """The original part, input normalised, marked as an interrupted call."""
    return {
        **part,
        "input": normalize_input(part.get("input")),
        "state": "output-error",
        "errorText": INTERRUPTED_TOOL_ERROR,
    }


@dataclass
class RepairReport:
    messages: list[UIMessage]
    changed: list[UIMessage] = field(default_factory=list)  # the messages that were rewritten
    removed_tool_calls: int = 0
    normalized_inputs: int = 0
    tool_call_ids: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return bool(self.changed)

    def event(self) -> dict[str, Any]:
        return {
            "removedToolCalls": self.removed_tool_calls,
            "normalizedInputs": self.normalized_inputs,
            "toolCallIds": list(self.tool_call_ids),
        }


def _repair_part(part: Part, repair: Callable[[Part], Part], report: RepairReport) -> Part:
    if not is_repairable(part):
        return part
    if is_settled(part) or part.get("state") == "approval-responded":
        # Settled or approved (it waits for its continuation to run): only the input is normalised.
        normalized = normalize_input(part.get("input"))
        if "input" in part and normalized is part.get("input"):
            return part
        report.normalized_inputs += 1
        return {**part, "input": normalized}
    replacement = repair(dict(part))
    if is_tool_part(replacement) and not is_settled(replacement):
        raise ValueError(
            f"repair_interrupted_tool_part returned an unsettled tool part for call {part['toolCallId']!r}"
        )
    report.removed_tool_calls += 1
    report.tool_call_ids.append(str(part["toolCallId"]))
    return replacement


def repair_transcript(messages: list[UIMessage], repair: Callable[[Part], Part]) -> RepairReport:
    """Repair every message; unchanged messages keep their identity, and nothing changes when none need it."""
    report = RepairReport(messages=[])
    for message in messages:
        parts = message.get("parts") or []
        new_parts = [_repair_part(p, repair, report) for p in parts]
        if any(new is not old for new, old in zip(new_parts, parts, strict=True)):
            message = {**message, "parts": new_parts}
            report.changed.append(message)
        report.messages.append(message)
    return report


def pending_interaction(messages: list[UIMessage], client_tool_names: set[str]) -> bool:
    """A human must act: an approval is requested, or a client tool waits for its result.

    A server tool left in `input-available` is not pending: its execution died with its worker.
    """
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for part in message.get("parts") or []:
            state = part.get("state")
            if state == "approval-requested":
                return True
            if state == "input-available" and is_tool_part(part) and tool_name_of(part) in client_tool_names:
                return True
    return False


def batch_complete(message: UIMessage) -> bool:
    """Every tool call of the message has a result or an approval decision: it may be continued."""
    for part in message.get("parts") or []:
        if is_repairable(part) and not is_settled(part) and part.get("state") != "approval-responded":
            return False
    return True
