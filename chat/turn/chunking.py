"""Provider deltas -> AI SDK UI message stream chunks (the v6 chunk set, so both client majors work)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from recovery.stream.buffer import Chunk as BufferedChunk
from recovery.stream.buffer import ChunkPolicy

from ..types import Chunk
from .llm import Event, ReasoningDelta, StepFinish, TextDelta, ToolCallDelta, Usage


@dataclass(frozen=True)
class ToolCall:
    """A tool call whose input the model finished; `input` is None when it was not a JSON object."""

    id: str
    name: str
    input: dict[str, Any] | None


FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool-calls",
    "content_filter": "content-filter",
}


class UIChunker:
    """Turns one model step's events into UI chunks; one instance per assistant message."""

    def __init__(self, message_id: str, *, dynamic: Mapping[str, str | None] | None = None) -> None:
        self.message_id = message_id
        # The tools whose calls are `dynamic-tool` parts (an MCP server's) -> their calls' title.
        self.dynamic: Mapping[str, str | None] = dynamic or {}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.step_usage: Usage | None = None
        self.cost: Decimal | None = None  # the priced steps' cost (chat.turn.pricing), None: none priced
        self._blocks = 0
        self._open: dict[str, str] = {}  # "text" / "reasoning" -> open part id
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._ready_calls: list[ToolCall] = []

    def start(self, *, metadata: dict[str, Any] | None = None, continuation: bool = False) -> list[Chunk]:
        """A continuation's start names no message: clients append it to the message it continues
        (ai@7 starts afresh on a new id, and would lose an approved call's output for that message)."""
        start: Chunk = {"type": "start"} if continuation else {"type": "start", "messageId": self.message_id}
        if metadata:
            start["messageMetadata"] = metadata
        return [start]

    def step_start(self) -> list[Chunk]:
        self.finish_reason = None
        return [{"type": "start-step"}]

    def begin(self, *, metadata: dict[str, Any] | None = None) -> list[Chunk]:
        """start + start-step: the opening of a one-step message."""
        return self.start(metadata=metadata) + self.step_start()

    def feed(self, event: Event) -> list[Chunk]:
        if isinstance(event, TextDelta):
            return self._delta("text", event.text)
        if isinstance(event, ReasoningDelta):
            return self._delta("reasoning", event.text)
        if isinstance(event, ToolCallDelta):
            return self._tool_delta(event)
        if isinstance(event, StepFinish):
            self.finish_reason = FINISH_REASONS.get(event.finish_reason, "other")
            return self._close_blocks() + self._tool_inputs_available()
        if isinstance(event, Usage):  # totals over the steps; the last step's own figures too
            self.step_usage = event
            prior = self.usage
            self.usage = (
                event
                if prior is None
                else Usage(
                    prior.prompt_tokens + event.prompt_tokens,
                    prior.completion_tokens + event.completion_tokens,
                    prior.total_tokens + event.total_tokens,
                    prior.cached_tokens + event.cached_tokens,
                )
            )
        return []

    def add_cost(self, cost: Decimal | None) -> None:
        """A step's cost, for the message's metadata (None: the step was not priced)."""
        if cost is not None:
            self.cost = cost if self.cost is None else self.cost + cost

    def _delta(self, kind: str, text: str) -> list[Chunk]:
        chunks: list[Chunk] = []
        other = "reasoning" if kind == "text" else "text"
        if other in self._open:
            chunks.append({"type": f"{other}-end", "id": self._open.pop(other)})
        if kind not in self._open:
            self._blocks += 1
            self._open[kind] = f"{kind[0]}{self._blocks}"
            chunks.append({"type": f"{kind}-start", "id": self._open[kind]})
        chunks.append({"type": f"{kind}-delta", "id": self._open[kind], "delta": text})
        return chunks

    def _close_blocks(self) -> list[Chunk]:
        chunks: list[Chunk] = [{"type": f"{kind}-end", "id": part_id} for kind, part_id in self._open.items()]
        self._open.clear()
        return chunks

    def _tool_delta(self, event: ToolCallDelta) -> list[Chunk]:
        call = self._tool_calls.get(event.index)
        chunks: list[Chunk] = []
        if call is None:
            call = {
                # A provider that names no call: an id unique across steps and across the
                # continuations that extend this message.
                "id": event.id or f"call_{uuid.uuid4().hex[:16]}",
                "name": event.name or "",
                "args": "",
            }
            self._tool_calls[event.index] = call
            chunks += self._close_blocks()
            chunks.append(
                self._call({"type": "tool-input-start", "toolCallId": call["id"], "toolName": call["name"]})
            )
        if event.arguments:
            call["args"] += event.arguments
            chunks.append(
                {"type": "tool-input-delta", "toolCallId": call["id"], "inputTextDelta": event.arguments}
            )
        return chunks

    def _tool_inputs_available(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        for call in self._tool_calls.values():
            try:
                parsed = json.loads(call["args"] or "{}")
            except ValueError:
                parsed = None
            self._ready_calls.append(
                ToolCall(call["id"], call["name"], parsed if isinstance(parsed, dict) else None)
            )
            if isinstance(parsed, dict):
                chunks.append(
                    self._call(
                        {
                            "type": "tool-input-available",
                            "toolCallId": call["id"],
                            "toolName": call["name"],
                            "input": parsed,
                        }
                    )
                )
            else:
                chunks.append(
                    self._call(
                        {
                            "type": "tool-input-error",
                            "toolCallId": call["id"],
                            "toolName": call["name"],
                            "input": call["args"],
                            "errorText": "The model produced tool input that is not a JSON object.",
                        }
                    )
                )
        self._tool_calls.clear()
        return chunks

    def _call(self, chunk: Chunk) -> Chunk:
        """A call chunk, marked `dynamic` for a tool known only at run time (its part: `dynamic-tool`),
        with the title that names where it runs."""
        if chunk["toolName"] in self.dynamic:
            chunk["dynamic"] = True
            title = self.dynamic[chunk["toolName"]]
            if title:
                chunk["title"] = title
        return chunk

    @property
    def tool_calls_pending(self) -> bool:
        return bool(self._tool_calls)

    def take_tool_calls(self) -> list[ToolCall]:
        """The calls whose input became available since the last call (the runner executes them)."""
        calls, self._ready_calls = self._ready_calls, []
        return calls

    def step_end(self) -> list[Chunk]:
        """Close what the step left open (a stream cut before its finish reason)."""
        return self._close_blocks() + self._tool_inputs_available()

    def end(self) -> list[Chunk]:
        """step_end + finish-step + finish: the close of a one-step message."""
        return [*self.step_end(), {"type": "finish-step"}, *self.finish()]

    def finish(self) -> list[Chunk]:
        finish: Chunk = {"type": "finish", "finishReason": self.finish_reason or "stop"}
        if self.usage is not None:
            usage: dict[str, Any] = {
                "promptTokens": self.usage.prompt_tokens,
                "completionTokens": self.usage.completion_tokens,
                "totalTokens": self.usage.total_tokens,
                "cachedTokens": self.usage.cached_tokens,
            }
            if self.cost is not None:  # a string: a Decimal, which JSON numbers would round
                usage["cost"] = str(self.cost)
            finish["messageMetadata"] = {"usage": usage}
        return [finish]


# -- what the chunks mean to the durable stream buffer (recovery.stream.buffer.ChunkPolicy) ---------

SETTLED_TOOL_CHUNKS = frozenset({"tool-output-available", "tool-output-error", "tool-output-denied"})
_COALESCED = {
    "text-delta": ("id", "delta"),
    "reasoning-delta": ("id", "delta"),
    "tool-input-delta": ("toolCallId", "inputTextDelta"),
}


# The most text one delta chunk carries. A flush may gather half a megabyte of deltas, and JSON escapes
# (a newline is 3 bytes once the chunk sits in its frame) could take one frame past daphne's 1 MiB, which
# closes the socket with 1011; 64,000 characters stay under 400 KB whatever they are.
DELTA_PIECE_CHARS = 64_000


def coalesce(chunks: list[BufferedChunk]) -> list[BufferedChunk]:
    """Consecutive deltas of one part become one chunk (its text is theirs, joined): what a client
    folds from them is the same message, and there is one chunk to store and one frame to send.
    No delta chunk comes out with more than DELTA_PIECE_CHARS of text: a longer one is cut in pieces."""
    merged: list[BufferedChunk] = []
    for chunk in chunks:
        rule = _COALESCED.get(chunk.get("type"))  # type: ignore[arg-type]
        if rule is None:
            merged.append(chunk)
            continue
        key, text = rule
        if merged:
            last = merged[-1]
            if (
                last.get("type") == chunk.get("type")
                and last.get(key) == chunk.get(key)
                and len(last) == len(chunk)  # no other field (providerMetadata) that a merge would lose
                and isinstance(last.get(text), str)
                and isinstance(chunk.get(text), str)
                and len(last[text]) + len(chunk[text]) <= DELTA_PIECE_CHARS
            ):
                merged[-1] = {**last, text: last[text] + chunk[text]}
                continue
        value = chunk.get(text)
        if isinstance(value, str) and len(value) > DELTA_PIECE_CHARS:
            merged.extend(
                {**chunk, text: value[start : start + DELTA_PIECE_CHARS]}
                for start in range(0, len(value), DELTA_PIECE_CHARS)
            )
            continue
        merged.append(chunk)
    return merged


def _delta_size(chunk: BufferedChunk) -> int:
    delta = chunk.get("delta")
    return len(delta) if isinstance(delta, str) else 64


def _omitted(seq: int) -> Chunk:
    """A transient data part in place of a chunk too large to store: a replay shows nothing for it."""
    return {"type": "data-think-omitted", "data": {"seq": seq}, "transient": True}


UI_CHUNK_POLICY = ChunkPolicy(
    # Stored at once: a settled result must never run again, and a human may act on these right away.
    immediate=SETTLED_TOOL_CHUNKS | {"tool-input-available", "tool-approval-request"},
    content=frozenset({"text-delta", "reasoning-delta", "tool-input-available"}),
    milestones=SETTLED_TOOL_CHUNKS
    | {"text-start", "reasoning-start", "tool-input-available", "tool-approval-request"},
    deltas=frozenset({"text-delta", "reasoning-delta", "tool-input-delta"}),
    merge=coalesce,
    size=_delta_size,
    omitted=_omitted,
)
