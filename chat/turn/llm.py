"""The one module that talks to litellm: a streaming model call turned into plain events.

Two kinds of call: Chat Completions (`stream_chat`, every provider), and OpenAI's Responses API in
background mode (`stream_response`, for agents with `model_reattach`), whose generation the provider
keeps and lets a client rejoin by response id after a given event (`Marked` events carry where the
stored generation stands). litellm is imported lazily so that migrate, the admin and beat never pay for
its import, and a worker whose models need none of it (chat.turn.plain_openai) never imports it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from ..conf import think_setting
from ..exceptions import ReattachUnavailable, ResponseFailed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class StepFinish:
    finish_reason: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those the provider read from its prompt cache


Event = TextDelta | ReasoningDelta | ToolCallDelta | StepFinish | Usage


@dataclass(frozen=True)
class ResponseCursor:
    """Where a provider's stored generation stands: its response id and the sequence number of the
    last event accounted for; `done` once the response completed."""

    response_id: str
    sequence_number: int
    done: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"responseId": self.response_id, "sequenceNumber": self.sequence_number, "done": self.done}

    @classmethod
    def from_json(cls, data: Any) -> ResponseCursor | None:
        """The cursor a fiber snapshot recorded; None for anything else."""
        if not isinstance(data, dict):
            return None
        response_id, number = data.get("responseId"), data.get("sequenceNumber")
        if not isinstance(response_id, str) or not response_id or not isinstance(number, int):
            return None
        return cls(response_id, number, bool(data.get("done")))


@dataclass(frozen=True)
class Marked:
    """An event of a stored generation (None: one that carries no content), and the cursor after it."""

    event: Event | None
    cursor: ResponseCursor


def load_litellm() -> Any:
    """Import litellm (seconds, the first time). Never call this on an event loop that runs turns."""
    # Without it litellm fetches its cost map over the network at import. Set here, not when this module
    # is imported, so a host process that never calls a model keeps its environment as it was.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    first = "litellm" not in sys.modules
    started = time.monotonic()
    import litellm

    if first:
        logger.info("litellm imported in %.1f s", time.monotonic() - started)

    if not getattr(litellm, "_think_configured", False):
        litellm.suppress_debug_info = True
        # litellm streams a Responses API call to a model its cost map does not know by faking it: one
        # blocking call, replayed as events; for a background response that is the queued response and
        # nothing more. So the site's own models are made known (a real provider's are in the map).
        models = think_setting("LITELLM_MODELS")
        if models:
            litellm.register_model(dict(models))
        litellm._think_configured = True
    return litellm


async def ensure_litellm() -> Any:
    """litellm, imported off the loop the first time (a chat.turn.plain_openai call needs none)."""
    # The first import takes seconds; on the loop it would starve every turn's heartbeat.
    if "litellm" in sys.modules:
        return load_litellm()
    return await asyncio.get_running_loop().run_in_executor(None, load_litellm)


def _events_of(chunk: Any) -> list[Event]:
    events: list[Event] = []
    for choice in getattr(chunk, "choices", None) or []:
        delta = getattr(choice, "delta", None)
        if delta is not None:
            reasoning = getattr(delta, "reasoning_content", None)
            if reasoning:
                events.append(ReasoningDelta(reasoning))
            if delta.content:
                events.append(TextDelta(delta.content))
            for call in getattr(delta, "tool_calls", None) or []:
                function = getattr(call, "function", None)
                events.append(
                    ToolCallDelta(
                        index=getattr(call, "index", 0) or 0,
                        id=getattr(call, "id", None),
                        name=getattr(function, "name", None) if function else None,
                        arguments=(getattr(function, "arguments", None) or "") if function else "",
                    )
                )
        if getattr(choice, "finish_reason", None):
            events.append(StepFinish(choice.finish_reason))
    usage = getattr(chunk, "usage", None)
    if usage is not None and getattr(usage, "total_tokens", None):
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        events.append(
            Usage(
                usage.prompt_tokens or 0, usage.completion_tokens or 0, usage.total_tokens or 0, cached or 0
            )
        )
    return events


async def stream_chat(
    *, model: dict[str, Any], messages: list[dict[str, Any]], lean: bool = True, **extra: Any
) -> AsyncGenerator[Event, None]:
    """Stream one model call. Provider errors surface as litellm exceptions (one retry budget: ours).

    `lean`: read an OpenAI-compatible provider's stream with `chat.turn.openai_compat` (litellm still routes
    and builds the request, and maps its errors); any other provider streams through litellm.
    """
    if lean:
        from . import openai_compat, plain_openai

        request = plain_openai.request(model, messages, **extra)  # no litellm needed for it
        if request is None:
            await ensure_litellm()
            request = openai_compat.lean_request(model, messages, **extra)
        if request is not None:
            async for event in openai_compat.stream(request):
                yield event
            return
    litellm = await ensure_litellm()
    kwargs = {"num_retries": 0, **model, **extra}
    response = await litellm.acompletion(
        messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    try:
        async for chunk in response:
            for event in _events_of(chunk):
                yield event
    finally:
        aclose = getattr(response, "aclose", None)
        if aclose is not None:
            await aclose()


async def complete_text(*, model: dict[str, Any], messages: list[dict[str, Any]], **extra: Any) -> str:
    """One non-streamed model call; its text (used to summarise a history)."""
    litellm = await ensure_litellm()
    response = await litellm.acompletion(messages=messages, **{"num_retries": 0, **model, **extra})
    return str(response.choices[0].message.content or "")


def error_text(exc: BaseException) -> str:
    """A short human-readable text for a provider error."""
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return str(message)


# -- the Responses API ----------------------------------------------------------------------------------
def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _input_part(part: dict[str, Any]) -> dict[str, Any]:
    """A chat API content part (chat.transcript.model_messages) as a Responses API input part."""
    if part.get("type") == "image_url":
        return {"type": "input_image", "image_url": part["image_url"]["url"]}
    if part.get("type") == "file":
        file = part["file"]
        return {"type": "input_file", "file_data": file["file_data"], "filename": file.get("filename")}
    return {"type": "input_text", "text": str(part.get("text", ""))}


def response_input(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """Chat Completions messages as the Responses API's (instructions, input items)."""
    instructions = [_text_of(m.get("content")) for m in messages if m.get("role") == "system"]
    items: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if role == "user" and isinstance(content, list) and any(p.get("type") != "text" for p in content):
            items.append({"role": role, "content": [_input_part(p) for p in content]})
        elif role in ("user", "assistant"):
            text = _text_of(content)
            if text:
                items.append({"role": role, "content": text})
        if role in ("user", "assistant"):
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.get("id"),
                        "name": function.get("name"),
                        "arguments": function.get("arguments") or "{}",
                    }
                )
        elif role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.get("tool_call_id"),
                    "output": _text_of(message.get("content")),
                }
            )
    return ("\n\n".join(instructions) or None), items


def response_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat Completions tool schemas as Responses API function tools."""
    converted = []
    for tool in tools:
        function = tool.get("function") or {}
        entry = {"type": "function", "name": function.get("name"), "parameters": function.get("parameters")}
        if function.get("description"):
            entry["description"] = function["description"]
        converted.append(entry)
    return converted


def _field(event: Any, name: str, default: Any = None) -> Any:
    if isinstance(event, dict):
        return event.get(name, default)
    return getattr(event, name, default)


class _ResponseEvents:
    """Turns Responses API stream events into Marked events; tracks the response id and tool calls."""

    def __init__(self, response_id: str | None = None) -> None:
        self.response_id = response_id
        self.calls: dict[int, int] = {}  # output_index -> tool call index of this stream
        self.saw_calls = False

    def cursor(self, event: Any, done: bool = False) -> ResponseCursor | None:
        number = _field(event, "sequence_number")
        if self.response_id is None or not isinstance(number, int):
            return None
        return ResponseCursor(self.response_id, number, done)

    def translate(self, event: Any) -> list[Event | Marked]:
        kind = _field(event, "type")
        if kind in ("response.created", "response.in_progress", "response.queued"):
            self.response_id = self.response_id or _field(_field(event, "response"), "id")
            return self._marked(None, event)
        if kind == "response.output_text.delta":
            return self._marked(TextDelta(str(_field(event, "delta") or "")), event)
        if kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            return self._marked(ReasoningDelta(str(_field(event, "delta") or "")), event)
        if kind == "response.output_item.added":
            item = _field(event, "item")
            if _field(item, "type") != "function_call":
                return []
            index = self.calls.setdefault(int(_field(event, "output_index") or 0), len(self.calls))
            self.saw_calls = True
            # Unmarked: a call is only stored whole, so a resume never starts inside one.
            return [ToolCallDelta(index, _field(item, "call_id"), _field(item, "name"), "")]
        if kind == "response.function_call_arguments.delta":
            known = self.calls.get(int(_field(event, "output_index") or 0))
            if known is None:
                return []
            return [ToolCallDelta(known, None, None, str(_field(event, "delta") or ""))]
        if kind == "response.output_item.done":
            return self._marked(None, event)
        if kind in ("response.completed", "response.incomplete"):
            response = _field(event, "response")
            events: list[Event | Marked] = []
            usage = _field(response, "usage")
            if usage is not None:
                prompt, completion = _field(usage, "input_tokens") or 0, _field(usage, "output_tokens") or 0
                cached = _field(_field(usage, "input_tokens_details"), "cached_tokens") or 0
                total = _field(usage, "total_tokens") or prompt + completion
                events.append(Usage(prompt, completion, total, cached))
            output = _field(response, "output") or []
            calls = self.saw_calls or any(_field(item, "type") == "function_call" for item in output)
            reason = "length" if kind == "response.incomplete" else ("tool_calls" if calls else "stop")
            cursor = self.cursor(event, done=True)
            finish = StepFinish(reason)
            events.append(Marked(finish, cursor) if cursor is not None else finish)
            return events
        if kind in ("response.failed", "error"):
            error = _field(_field(event, "response"), "error") or event
            message = str(_field(error, "message") or "the provider reported the response failed")
            code = _field(error, "code")
            raise ResponseFailed(message, str(code) if code else None)
        return []

    def _marked(self, event: Event | None, raw: Any) -> list[Event | Marked]:
        cursor = self.cursor(raw)
        if cursor is None:
            return [event] if event is not None else []
        return [Marked(event, cursor)]


def _is_not_found(exc: BaseException) -> bool:
    return getattr(exc, "status_code", None) == 404 or type(exc).__name__ in ("NotFoundError",)


async def stream_response(
    *,
    model: dict[str, Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    resume: ResponseCursor | None = None,
) -> AsyncGenerator[Event | Marked, None]:
    """Stream one model step through the Responses API in background mode: a new generation, or (with
    `resume`) the rest of a stored one after `resume.sequence_number`. ReattachUnavailable when the
    provider no longer has it."""
    litellm = await ensure_litellm()
    kwargs = {"num_retries": 0, **model}
    translator = _ResponseEvents(resume.response_id if resume is not None else None)
    if resume is None:
        instructions, items = response_input(messages)
        extra: dict[str, Any] = {"tools": response_tools(tools)} if tools else {}
        if instructions:
            extra["instructions"] = instructions
        response = await litellm.aresponses(
            input=items, background=True, stream=True, store=True, **extra, **kwargs
        )
    else:
        try:
            response = await litellm.aget_responses(
                response_id=resume.response_id,
                stream=True,
                starting_after=resume.sequence_number,
                **_retrieve_kwargs(kwargs),
            )
        except Exception as exc:  # whatever it is, the turn can still continue the ordinary way
            if _is_not_found(exc):
                gone = f"the provider no longer has response {resume.response_id}"
                raise ReattachUnavailable("not_found", gone) from exc
            raise ReattachUnavailable("unavailable", f"{type(exc).__name__}: {error_text(exc)}") from exc
    try:
        async for event in response:
            for translated in translator.translate(event):
                yield translated
    finally:
        aclose = getattr(response, "aclose", None)
        if aclose is not None:
            await aclose()


def _retrieve_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The connection part of a model's kwargs, for a retrieve (which names no model)."""
    model = str(kwargs.get("model") or "")
    provider = model.split("/", 1)[0] if "/" in model else "openai"
    wanted = {k: v for k, v in kwargs.items() if k in ("api_base", "api_key", "timeout", "extra_headers")}
    return {"custom_llm_provider": provider, **wanted}
