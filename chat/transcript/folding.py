"""Folding AI SDK UI message chunks into a UIMessage.

One accumulator serves the worker (the message it persists), recovery (the partial it rebuilds from
stored segments) and the orphan finaliser, so all three agree on what a stream means.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any, cast

from ..types import Chunk, Part, UIMessage

SETTLED_TOOL_STATES = frozenset({"output-available", "output-error", "output-denied"})


def is_tool_part(part: Part) -> bool:
    part_type = part.get("type")
    return isinstance(part_type, str) and (part_type.startswith("tool-") or part_type == "dynamic-tool")


def tool_name_of(part: Part) -> str:
    if part.get("type") == "dynamic-tool":
        return str(part.get("toolName", ""))
    return str(part.get("type", ""))[len("tool-") :]


def is_settled_tool_part(part: Part) -> bool:
    return is_tool_part(part) and (
        "output" in part or "result" in part or part.get("state") in SETTLED_TOOL_STATES
    )


class MessageAccumulator:
    """Builds one assistant UIMessage from the chunks of a stream.

    A continuation's stream extends the message it continues: its accumulator starts from that
    message (`extending`), so what it folds is the whole message, as clients render it.
    """

    def __init__(self, message_id: str, *, role: str = "assistant") -> None:
        self.message_id = message_id
        self.role = role
        self.parts: list[Part] = []
        self.metadata: dict[str, Any] | None = None
        # A tool result was settled by this stream's own chunks (not inherited from an extended message).
        self.settled_results = False
        self.error_text: str | None = None
        self.finish_reason: str | None = None
        self._open: dict[tuple[str, str], Part] = {}  # (kind, id) -> streaming text/reasoning part
        self._tool_input_text: dict[str, str] = {}
        # Tool results for calls that live in an earlier message (approved tools run in a continuation).
        self.foreign_tool_updates: list[dict[str, Any]] = []

    @classmethod
    def extending(cls, message: UIMessage) -> MessageAccumulator:
        """An accumulator that continues `message` (a copy: the original is left as it is)."""
        accumulator = cls(str(message["id"]), role=str(message.get("role") or "assistant"))
        accumulator.parts = copy.deepcopy(list(message.get("parts") or []))
        metadata = message.get("metadata")
        accumulator.metadata = copy.deepcopy(metadata) if isinstance(metadata, dict) else None
        return accumulator

    # -- reading -------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        return "".join(str(p.get("text", "")) for p in self.parts if p.get("type") == "text")

    @property
    def has_content(self) -> bool:
        return any(p.get("type") != "step-start" for p in self.parts)

    @property
    def has_settled_tool_results(self) -> bool:
        """This stream settled a tool call (a result that must never be dropped, nor run again)."""
        return self.settled_results

    def close_open_parts(self) -> None:
        """A stream cut short (a cancel): its open text and reasoning parts are final as they are."""
        for part in self._open.values():
            part["state"] = "done"
        self._open.clear()

    def message(self) -> UIMessage:
        message: UIMessage = {"id": self.message_id, "role": self.role, "parts": self.parts}
        if self.metadata:
            message["metadata"] = self.metadata
        return message

    # -- folding -------------------------------------------------------------------------------
    def apply_body(self, body: str) -> None:
        """Fold one stored chunk body; malformed bodies are skipped."""
        try:
            chunk = json.loads(body)
        except ValueError:
            return
        if isinstance(chunk, dict):
            self.apply(cast(Chunk, chunk))

    def apply(self, chunk: Chunk) -> None:
        chunk_type = chunk.get("type")
        if not isinstance(chunk_type, str):
            return
        handler = _HANDLERS.get(chunk_type)
        if handler is not None:
            handler(self, chunk)
        elif chunk_type.startswith("data-"):
            self._apply_data(chunk)

    def _merge_metadata(self, chunk: Chunk, key: str = "messageMetadata") -> None:
        extra = chunk.get(key)
        if isinstance(extra, dict):
            self.metadata = {**(self.metadata or {}), **extra}

    def _start(self, chunk: Chunk) -> None:
        if isinstance(chunk.get("messageId"), str) and chunk["messageId"]:
            self.message_id = chunk["messageId"]
        self._merge_metadata(chunk)

    def _step_start(self, chunk: Chunk) -> None:
        self.parts.append({"type": "step-start"})

    def _finish_step(self, chunk: Chunk) -> None:
        self._open.clear()

    def _finish(self, chunk: Chunk) -> None:
        if isinstance(chunk.get("finishReason"), str):
            self.finish_reason = chunk["finishReason"]
        self._merge_metadata(chunk)
        for part in self._open.values():
            part["state"] = "done"
        self._open.clear()

    def _block_start(self, kind: str, chunk: Chunk) -> None:
        part: Part = {"type": kind, "text": "", "state": "streaming"}
        if isinstance(chunk.get("providerMetadata"), dict):
            part["providerMetadata"] = chunk["providerMetadata"]
        self.parts.append(part)
        self._open[(kind, str(chunk.get("id", "")))] = part

    def _block_delta(self, kind: str, chunk: Chunk) -> None:
        part = self._open.get((kind, str(chunk.get("id", ""))))
        if part is None:  # a delta without its start: open the part rather than lose the text
            self._block_start(kind, chunk)
            part = self._open[(kind, str(chunk.get("id", "")))]
        part["text"] += str(chunk.get("delta", ""))

    def _block_end(self, kind: str, chunk: Chunk) -> None:
        part = self._open.pop((kind, str(chunk.get("id", ""))), None)
        if part is not None:
            part["state"] = "done"

    def _find_tool(self, tool_call_id: Any) -> Part | None:
        for part in self.parts:
            if is_tool_part(part) and part.get("toolCallId") == tool_call_id:
                return part
        return None

    def _tool_part(self, chunk: Chunk) -> Part:
        part = self._find_tool(chunk.get("toolCallId"))
        if part is None:
            name = str(chunk.get("toolName", ""))
            part = (
                {"type": "dynamic-tool", "toolName": name}
                if chunk.get("dynamic")
                else {"type": f"tool-{name}"}
            )
            part.update({"toolCallId": chunk.get("toolCallId"), "state": "input-streaming", "input": None})
            for key in ("providerExecuted", "title"):
                if key in chunk:
                    part[key] = chunk[key]
            self.parts.append(part)
        return part

    def _tool_input_start(self, chunk: Chunk) -> None:
        self._tool_part(chunk)
        self._tool_input_text[str(chunk.get("toolCallId"))] = ""

    def _tool_input_delta(self, chunk: Chunk) -> None:
        key = str(chunk.get("toolCallId"))
        self._tool_input_text[key] = self._tool_input_text.get(key, "") + str(chunk.get("inputTextDelta", ""))

    def _tool_input_available(self, chunk: Chunk) -> None:
        part = self._tool_part(chunk)
        part["state"] = "input-available"
        part["input"] = chunk.get("input")

    def _tool_input_error(self, chunk: Chunk) -> None:
        self.settled_results = True
        part = self._tool_part(chunk)
        part.update(state="output-error", input=chunk.get("input"), errorText=chunk.get("errorText", ""))

    def _tool_approval_request(self, chunk: Chunk) -> None:
        part = self._find_tool(chunk.get("toolCallId"))
        if part is not None:
            part["state"] = "approval-requested"
            part["approval"] = {"id": chunk.get("approvalId")}

    def _tool_settle(self, chunk: Chunk, changes: dict[str, Any]) -> None:
        part = self._find_tool(chunk.get("toolCallId"))
        if part is None:
            self.foreign_tool_updates.append({"toolCallId": chunk.get("toolCallId"), **changes})
            return
        part.update(changes)
        self.settled_results = True

    def _tool_output_available(self, chunk: Chunk) -> None:
        changes = {"state": "output-available", "output": chunk.get("output")}
        if chunk.get("preliminary"):
            changes["preliminary"] = True
        self._tool_settle(chunk, changes)
        part = self._find_tool(chunk.get("toolCallId"))
        if part is not None and not chunk.get("preliminary"):
            part.pop("preliminary", None)  # the final output replaces a preliminary one

    def _tool_output_error(self, chunk: Chunk) -> None:
        self._tool_settle(chunk, {"state": "output-error", "errorText": chunk.get("errorText", "")})

    def _tool_output_denied(self, chunk: Chunk) -> None:
        self._tool_settle(chunk, {"state": "output-denied"})

    def _append_as_part(self, chunk: Chunk) -> None:
        self.parts.append(dict(chunk))

    def _error(self, chunk: Chunk) -> None:
        self.error_text = str(chunk.get("errorText", ""))

    def _apply_data(self, chunk: Chunk) -> None:
        if chunk.get("transient"):
            return
        part = {k: v for k, v in chunk.items() if k != "transient"}
        if "id" in part:
            for existing in self.parts:
                if existing.get("type") == part["type"] and existing.get("id") == part["id"]:
                    existing["data"] = part.get("data")
                    return
        self.parts.append(part)


_HANDLERS: dict[str, Any] = {
    "start": MessageAccumulator._start,
    "start-step": MessageAccumulator._step_start,
    "finish-step": MessageAccumulator._finish_step,
    "finish": MessageAccumulator._finish,
    "text-start": lambda acc, c: acc._block_start("text", c),
    "text-delta": lambda acc, c: acc._block_delta("text", c),
    "text-end": lambda acc, c: acc._block_end("text", c),
    "reasoning-start": lambda acc, c: acc._block_start("reasoning", c),
    "reasoning-delta": lambda acc, c: acc._block_delta("reasoning", c),
    "reasoning-end": lambda acc, c: acc._block_end("reasoning", c),
    "tool-input-start": MessageAccumulator._tool_input_start,
    "tool-input-delta": MessageAccumulator._tool_input_delta,
    "tool-input-available": MessageAccumulator._tool_input_available,
    "tool-input-error": MessageAccumulator._tool_input_error,
    "tool-approval-request": MessageAccumulator._tool_approval_request,
    "tool-output-available": MessageAccumulator._tool_output_available,
    "tool-output-error": MessageAccumulator._tool_output_error,
    "tool-output-denied": MessageAccumulator._tool_output_denied,
    "source-url": MessageAccumulator._append_as_part,
    "source-document": MessageAccumulator._append_as_part,
    "file": MessageAccumulator._append_as_part,
    "message-metadata": lambda acc, c: acc._merge_metadata(c),
    "error": MessageAccumulator._error,
}


def fold_bodies(
    message_id: str, bodies: Iterable[str], *, extends: UIMessage | None = None
) -> MessageAccumulator:
    """Rebuild a message from stored chunk bodies (recovery, orphan finalising), on top of the message
    a continuation's stream `extends`."""
    accumulator = (
        MessageAccumulator.extending(extends) if extends is not None else MessageAccumulator(message_id)
    )
    for body in bodies:
        accumulator.apply_body(body)
    return accumulator


def message_chunks(message: UIMessage) -> list[dict[str, Any]]:
    """The chunks that fold into `message` (a replay of a stored message: the inverse of folding).

    `fold_bodies` of their JSON gives the message back, but for what no chunk can say: an approval a
    human answered ("approval-responded") replays as the request it answered, and a denial without its
    approval record.
    """
    chunks: list[dict[str, Any]] = [{"type": "start", "messageId": message["id"]}]
    if isinstance(message.get("metadata"), dict):
        chunks[0]["messageMetadata"] = message["metadata"]
    for index, part in enumerate(message.get("parts") or []):
        chunks += _part_chunks(part, f"r{index}")
    return chunks


def _part_chunks(part: Part, block_id: str) -> list[dict[str, Any]]:
    kind = part.get("type")
    if kind == "step-start":
        return [{"type": "start-step"}]
    if kind in ("text", "reasoning"):
        start: dict[str, Any] = {"type": f"{kind}-start", "id": block_id}
        if isinstance(part.get("providerMetadata"), dict):
            start["providerMetadata"] = part["providerMetadata"]
        chunks = [start, {"type": f"{kind}-delta", "id": block_id, "delta": str(part.get("text", ""))}]
        return chunks + (
            [{"type": f"{kind}-end", "id": block_id}] if part.get("state") != "streaming" else []
        )
    if is_tool_part(part):
        return _tool_chunks(part)
    return [dict(part)]  # data-*, source-url, source-document, file: the chunk is the part


def _tool_chunks(part: Part) -> list[dict[str, Any]]:
    call = {"toolCallId": part.get("toolCallId"), "toolName": tool_name_of(part)}
    if part.get("type") == "dynamic-tool":
        call["dynamic"] = True
    call.update({key: part[key] for key in ("providerExecuted", "title") if key in part})
    state = part.get("state")
    if state == "input-streaming":
        return [{"type": "tool-input-start", **call}]
    if state == "output-error":
        error = {"input": part.get("input"), "errorText": part.get("errorText", "")}
        return [{"type": "tool-input-error", **call, **error}]
    chunks = [{"type": "tool-input-available", **call, "input": part.get("input")}]
    call_id = {"toolCallId": part.get("toolCallId")}
    if state in ("approval-requested", "approval-responded"):
        approval_id = (part.get("approval") or {}).get("id")
        chunks.append({"type": "tool-approval-request", "approvalId": approval_id, **call_id})
    elif state == "output-available":
        output = {"output": part.get("output")}
        if part.get("preliminary"):
            output["preliminary"] = True
        chunks.append({"type": "tool-output-available", **call_id, **output})
    elif state == "output-denied":
        chunks.append({"type": "tool-output-denied", **call_id})
    return chunks
