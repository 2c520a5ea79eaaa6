"""A UIMessage transcript as the chat-completions messages litellm expects."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from ..exceptions import FileRefused
from ..types import Part, UIMessage
from .files import Attachment, check_file, file_id_of, parse_data_url
from .folding import is_tool_part, tool_name_of


def _text_of(parts: list[Part]) -> str:
    return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


def _assistant_messages(parts: list[Part]) -> list[dict[str, Any]]:
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


def _tool_output_text(part: Part) -> str:
    if part.get("state") == "output-error":
        return f"Error: {part.get('errorText', '')}"
    if part.get("state") == "output-denied":
        reason = (part.get("approval") or {}).get("reason")
        return f"The user denied this tool call: {reason}" if reason else "The user denied this tool call."
    output = part.get("output")
    return output if isinstance(output, str) else json.dumps(output)


class _Files:
    """The files of one model call: each read from `files` (or an inline data URL), encoded once, and
    sent newest first while they fit in `budget` bytes; older ones are named, not sent."""

    def __init__(
        self, messages: list[UIMessage], files: Mapping[str, Attachment], budget: int | None
    ) -> None:
        self.files = files
        self.found: dict[int, Attachment | None] = {}  # id(part) -> its file
        self.encoded: dict[int, str] = {}  # id(attachment) -> its data URL
        self.sent: set[int] = set()  # id(part) of the parts whose bytes go
        remaining = budget
        for message in reversed(messages):
            if message["role"] == "assistant":
                continue
            for part in reversed(message.get("parts") or []):
                attachment = self.attachment(part) if part.get("type") == "file" else None
                if attachment is None:
                    continue
                if remaining is None or len(attachment.data) <= remaining:
                    self.sent.add(id(part))
                    remaining = None if remaining is None else remaining - len(attachment.data)

    def attachment(self, part: Part) -> Attachment | None:
        if id(part) not in self.found:
            url = str(part.get("url", ""))
            file_id = file_id_of(url)
            found = self.files.get(str(file_id)) if file_id is not None else None
            if found is None and url.startswith("data:"):  # stored inline before files were kept apart
                try:
                    media_type, data = parse_data_url(url)
                    check_file(media_type, data)
                    found = Attachment(media_type, data, str(part.get("filename") or ""))
                except FileRefused:
                    pass
            self.found[id(part)] = found
        return self.found[id(part)]

    def content(self, part: Part) -> dict[str, Any]:
        """A file as the model reads it: an image as an image, text as text, anything else (a PDF) as a
        file; a note in its place when it is gone or left out."""
        attachment = self.attachment(part)
        name = str(part.get("filename") or "") or "file"
        if attachment is None:
            return {"type": "text", "text": f"[The file {name} is no longer available.]"}
        if id(part) not in self.sent:
            return {"type": "text", "text": f"[The file {name} is left out: newer files fill this request.]"}
        media_type = attachment.media_type
        if media_type.startswith("text/") or media_type == "application/json":
            text = attachment.data.decode("utf-8", "replace")
            return {"type": "text", "text": f"[File {name} ({media_type})]\n{text}"}
        url = self.encoded.get(id(attachment))
        if url is None:
            url = f"data:{media_type};base64,{base64.b64encode(attachment.data).decode('ascii')}"
            self.encoded[id(attachment)] = url
        if media_type.startswith("image/"):
            return {"type": "image_url", "image_url": {"url": url}}
        return {"type": "file", "file": {"file_data": url, "filename": name}}


def _content(parts: list[Part], files: _Files) -> str | list[dict[str, Any]]:
    """A user's or system's content: its text, or, with files, content parts in the chat API's form,
    which litellm turns into each provider's (Anthropic's image and document blocks, Gemini's inline
    data, the Responses API's input items: chat.turn.llm)."""
    if not any(p.get("type") == "file" for p in parts):
        return _text_of(parts)
    content: list[dict[str, Any]] = []
    for part in parts:
        if part.get("type") == "text" and part.get("text"):
            content.append({"type": "text", "text": str(part["text"])})
        elif part.get("type") == "file":
            content.append(files.content(part))
    return content


def to_model_messages(
    messages: list[UIMessage],
    *,
    system_prompt: str | None = None,
    files: Mapping[str, Attachment] | None = None,
    max_file_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """The chat API's messages of a transcript; `files` holds the bytes of the files its file parts
    name, by file id (chat.transcript.files.attachments_for_model), of which the newest within
    `max_file_bytes` (THINK["MAX_MODEL_FILE_BYTES"] in a turn) are sent."""
    model_messages: list[dict[str, Any]] = []
    if system_prompt:
        model_messages.append({"role": "system", "content": system_prompt})
    carried = _Files(messages, files or {}, max_file_bytes)
    for message in messages:
        parts = message.get("parts") or []
        if message["role"] == "assistant":
            model_messages.extend(_assistant_messages(parts))
        else:
            model_messages.append({"role": message["role"], "content": _content(parts, carried)})
    return model_messages
