"""A UIMessage transcript as the chat-completions messages litellm expects."""

from __future__ import annotations

import json
from typing import Any

from .folding import is_tool_part, tool_name_of


def _text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


def _assistant_messages(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant UIMessage becomes one assistant message per step, each followed by its tool results."""
    result: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []

    def close_step() -> None:
        if not "".join(text) and not calls:
            text.clear()
            return
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            message["tool_calls"] = list(calls)
        result.append(message)
        result.extend(outputs)
        text.clear()
        calls.clear()
        outputs.clear()

    for part in parts:
        if part.get("type") == "step-start":
            close_step()
        elif part.get("type") == "text":
            text.append(str(part.get("text", "")))
        elif is_tool_part(part) and part.get("state") in (
            "output-available",
            "output-error",
            "output-denied",
        ):
            call_id = str(part.get("toolCallId"))
            arguments = json.dumps(part.get("input") if part.get("input") is not None else {})
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": tool_name_of(part), "arguments": arguments},
                }
            )
            outputs.append({"role": "tool", "tool_call_id": call_id, "content": _tool_output_text(part)})
    close_step()
    return result


def _tool_output_text(part: dict[str, Any]) -> str:
    if part.get("state") == "output-error":
        return f"Error: {part.get('errorText', '')}"
    if part.get("state") == "output-denied":
        reason = (part.get("approval") or {}).get("reason")
        return f"The user denied this tool call: {reason}" if reason else "The user denied this tool call."
    output = part.get("output")
    return output if isinstance(output, str) else json.dumps(output)


def to_model_messages(
    messages: list[dict[str, Any]], *, system_prompt: str | None = None
) -> list[dict[str, Any]]:
    model_messages: list[dict[str, Any]] = []
    if system_prompt:
        model_messages.append({"role": "system", "content": system_prompt})
    for message in messages:
        parts = message.get("parts") or []
        if message["role"] == "assistant":
            model_messages.extend(_assistant_messages(parts))
        else:
            model_messages.append({"role": message["role"], "content": _text_of(parts)})
    return model_messages
