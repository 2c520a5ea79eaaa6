"""The scripted model in Anthropic's and Gemini's dialects, so litellm's own code path for each runs.

:func:`add_routes` puts two more APIs on the scripted model's app (``build_app`` calls it); both answer
the prompts and directives of :mod:`think_scripted.server` (count, tools, tool-result follow-ups,
continuations, stall / fail / malformed / reset / overflow / window, ``once`` / ``always``, rate, stamp,
``[no finish]``), after turning the request into chat messages:

* Anthropic Messages -- ``POST /v1/messages`` (litellm: model ``anthropic/...``, ``api_base`` = the server
  root). ``system`` (a string or text blocks) is the system message; ``text``, ``tool_use`` and
  ``tool_result`` blocks are text, tool calls and tool results. A streamed reply is ``message_start``
  (``usage.input_tokens``), a ``ping``, one content block per text run or tool call
  (``content_block_start`` / ``_delta`` with ``text_delta`` or ``input_json_delta`` / ``_stop``),
  ``message_delta`` (``stop_reason`` ``end_turn`` or ``tool_use``, ``usage.output_tokens``) and
  ``message_stop``; without streaming, one ``message`` object. Errors have Anthropic's body
  ``{"type": "error", "error": {"type", "message"}}``: an overflow is a 400 ``invalid_request_error``
  ``prompt is too long: M tokens > N maximum``; 429 ``rate_limit_error`` (with ``retry-after``), 529
  ``overloaded_error``, other 5xx ``api_error``; mid-stream, ``[fail after K with S]`` sends an ``error``
  event of that type.
* Gemini -- ``POST /v1beta/models/{model}:streamGenerateContent?alt=sse`` and ``:generateContent``
  (litellm: model ``gemini/...``, ``api_base`` = the server root + ``/v1beta``). ``system_instruction``
  is the system message; ``contents`` with ``user`` / ``model`` roles and ``text``, ``functionCall`` and
  ``functionResponse`` parts. Gemini names no tool calls, so a function call is given the id
  ``call_<C>_<i>`` (content C, part i) and the function responses after it take those ids in order. A
  streamed reply is one ``GenerateContentResponse`` per word, a function call whole in one response when
  its last piece is due, and a last response with ``finishReason`` ``STOP``; every response carries
  ``usageMetadata`` so far. Errors have Google's body ``{"error": {"code", "message", "status"}}``: an
  overflow is a 400 ``INVALID_ARGUMENT`` ``The input token count (M) exceeds the maximum number of tokens
  allowed (N).``; 429 ``RESOURCE_EXHAUSTED``, 503 ``UNAVAILABLE`` (the model is overloaded), 500
  ``INTERNAL``; mid-stream, an ``error`` object in a data line.

``[no finish]`` drops what carries the finish reason (OpenAI's finish chunk, Anthropic's
``message_delta``, Gemini's ``finishReason``); the stream otherwise ends as usual.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from think_scripted.server import (
    RATE_LIMIT_RETRY_AFTER_S,
    STATE_KEY,
    BadRequestError,
    EarlyFault,
    Encoder,
    Json,
    Plan,
    _ConnectionReset,
    _note_prompt,
    complete_plan,
    count_prompt_tokens,
    early_fault,
    fault_message,
    log_plan,
    note_request,
    plan_reply,
    sse,
    stream_plan,
)

log = logging.getLogger("think_scripted.server.dialects")

ANTHROPIC_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use"}
ANTHROPIC_ERROR_TYPES = {429: "rate_limit_error", 529: "overloaded_error", 401: "authentication_error"}
ANTHROPIC_MESSAGES = {
    429: "Number of request tokens has exceeded your rate limit for the scripted model.",
    529: "Overloaded",
}
GEMINI_MESSAGES = {
    429: "Resource has been exhausted (e.g. check quota).",
    503: "The model is overloaded. Please try again later.",
}
GEMINI_STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def _text_of(blocks: Any) -> str:
    """The text of a content given as a string or as a list of text blocks / parts."""
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list):
        return "".join(str(b.get("text", "")) for b in blocks if isinstance(b, dict))
    return ""


def _tool_call(call_id: str, name: Any, arguments: Any) -> Json:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": str(name), "arguments": json.dumps(arguments)},
    }


# -- Anthropic Messages ---------------------------------------------------------------------------------


def anthropic_messages(body: Json) -> list[Json]:
    """The chat messages of a Messages API request body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequestError("messages: must be a non-empty list of message objects")
    chat: list[Json] = []
    system = _text_of(body.get("system"))
    if system:
        chat.append({"role": "system", "content": system})
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise BadRequestError(f"messages: role must be 'user' or 'assistant', got {role!r}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise BadRequestError("messages: content must be a string or a list of content blocks")
        text = "".join(
            str(b.get("text", "")) for b in blocks if isinstance(b, dict) and b.get("type") == "text"
        )
        calls = [
            _tool_call(str(b.get("id")), b.get("name"), b.get("input") or {})
            for b in blocks
            if isinstance(b, dict) and b.get("type") == "tool_use"
        ]
        for block in blocks:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                result = {"role": "tool", "tool_call_id": block.get("tool_use_id")}
                chat.append({**result, "content": _text_of(block.get("content"))})
        if role == "assistant":
            chat.append(
                {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
            )
        elif files := [f for b in blocks if isinstance(b, dict) and (f := _anthropic_file(b))]:
            chat.append({"role": "user", "content": [{"type": "text", "text": text}, *files]})
        elif text:
            chat.append({"role": "user", "content": text})
    return chat


def _file_part(media_type: Any, data: Any, name: Any = None) -> Json:
    """A file in the chat API's form (an ``image_url`` or a ``file`` part with a data URL)."""
    url = f"data:{media_type};base64,{data}"
    if str(media_type).startswith("image/"):
        return {"type": "image_url", "image_url": {"url": url}}
    return {"type": "file", "file": {"file_data": url, **({"filename": name} if name else {})}}


def _anthropic_file(block: Json) -> Json | None:
    """An ``image`` or ``document`` block with a base64 source, as a chat API file part."""
    source = block.get("source")
    if block.get("type") not in ("image", "document") or not isinstance(source, dict):
        return None
    if source.get("type") != "base64":
        raise BadRequestError(f"{block.get('type')} blocks must have a base64 source here")
    return _file_part(source.get("media_type"), source.get("data"), block.get("title"))


class AnthropicEncoder:
    """A Messages API reply: content blocks, one per text run or tool call."""

    def __init__(self, plan: Plan, model: str, prompt_tokens: int) -> None:
        self.plan, self.model, self.prompt_tokens = plan, model, prompt_tokens
        self.id = f"msg_scripted_{plan.serial}"
        self.blocks = -1  # the index of the open block
        self.open: str | None = None  # its kind: "text" or "tool_use"

    def opening(self) -> list[bytes]:
        message = {
            **self._message([], None),
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 1},
        }
        return [_event({"type": "message_start", "message": message}), _event({"type": "ping"})]

    def delta(self, index: int, delta: Json) -> list[bytes]:
        events: list[bytes] = []
        if delta.get("content") is not None:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""}, "text")
            change = {"type": "text_delta", "text": delta["content"]}
        else:
            [piece] = delta["tool_calls"]
            function = piece["function"]
            if "id" in piece:  # the first piece of a call: a new block
                block = {"type": "tool_use", "id": piece["id"], "name": function["name"], "input": {}}
                events += self._start(block, "tool_use")
                if not function["arguments"]:
                    return events
            change = {"type": "input_json_delta", "partial_json": function["arguments"]}
        return [*events, _event({"type": "content_block_delta", "index": self.blocks, "delta": change})]

    def _start(self, block: Json, kind: str) -> list[bytes]:
        events = self._stop()
        self.blocks, self.open = self.blocks + 1, kind
        return [
            *events,
            _event({"type": "content_block_start", "index": self.blocks, "content_block": block}),
        ]

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event({"type": "content_block_stop", "index": self.blocks})]

    def closing(self, sent: int, finish: bool) -> list[bytes]:
        events = self._stop()
        if finish:
            stop = {"stop_reason": ANTHROPIC_STOP_REASONS[self.plan.finish_reason], "stop_sequence": None}
            events.append(_event({"type": "message_delta", "delta": stop, "usage": {"output_tokens": sent}}))
        return [*events, _event({"type": "message_stop"})]

    def failure(self, status: int, sent: int) -> list[bytes]:
        return [_event(anthropic_error_body(status, f"Scripted failure after {sent} chunks."))]

    def broken(self) -> Json:
        return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " broken"}}

    def message(self, sent: int) -> Json:
        content: list[Json] = []
        for delta in self.plan.deltas:
            if delta.get("content") is not None:
                if not content or content[-1]["type"] != "text":
                    content.append({"type": "text", "text": ""})
                content[-1]["text"] += delta["content"]
                continue
            [piece] = delta["tool_calls"]
            if "id" in piece:
                content.append(
                    {"type": "tool_use", "id": piece["id"], "name": piece["function"]["name"], "args": ""}
                )
            content[-1]["args"] += piece["function"]["arguments"]
        for block in content:
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("args") or "{}")
        message = self._message(content, ANTHROPIC_STOP_REASONS[self.plan.finish_reason])
        return {**message, "usage": {"input_tokens": self.prompt_tokens, "output_tokens": sent}}

    def _message(self, content: list[Json], stop_reason: str | None) -> Json:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
        }


def _event(payload: Json) -> bytes:
    return sse(payload, event=payload["type"])


def anthropic_error_body(status: int, message: str) -> Json:
    kind = ANTHROPIC_ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(fault: EarlyFault) -> web.Response:
    message = fault_message(
        fault, "prompt is too long: {tokens} tokens > {window} maximum", ANTHROPIC_MESSAGES
    )
    headers = {"x-should-retry": "false", "request-id": f"req_scripted_{time.monotonic_ns()}"}
    if fault.status == 429:
        headers["retry-after"] = str(RATE_LIMIT_RETRY_AFTER_S)
    return web.json_response(
        anthropic_error_body(fault.status, message), status=fault.status, headers=headers
    )


async def anthropic_create(request: web.Request) -> web.StreamResponse:
    def encoder(body: Json, plan: Plan, prompt_tokens: int) -> Encoder:
        return AnthropicEncoder(plan, str(body.get("model") or "claude-scripted"), prompt_tokens)

    return await _answer(request, anthropic_messages, encoder, anthropic_error, stream=None)


# -- Gemini -----------------------------------------------------------------------------------------------


def gemini_messages(body: Json) -> list[Json]:
    """The chat messages of a ``generateContent`` request body (tool calls get ids, see the docstring)."""
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents or not all(isinstance(c, dict) for c in contents):
        raise BadRequestError("contents: must be a non-empty list of Content objects")
    system = _field(body, "systemInstruction", "system_instruction") or {}
    chat: list[Json] = []
    if _text_of(system.get("parts")):
        chat.append({"role": "system", "content": _text_of(system.get("parts"))})
    unanswered: list[str] = []  # the ids of the last model content's calls, in order
    for number, content in enumerate(contents):
        role, parts = content.get("role", "user"), content.get("parts")
        if role not in ("user", "model", "function") or not isinstance(parts, list):
            raise BadRequestError(f"contents[{number}]: needs role 'user' or 'model' and a list of parts")
        text = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict) and "text" in p)
        if role == "model":
            calls = [call for part in parts if (call := _field(part, "functionCall", "function_call"))]
            unanswered = [f"call_{number}_{i}" for i in range(len(calls))]
            tool_calls = [
                _tool_call(i, c.get("name"), c.get("args") or {})
                for i, c in zip(unanswered, calls, strict=True)
            ]
            chat.append(
                {
                    "role": "assistant",
                    "content": text or None,
                    **({"tool_calls": tool_calls} if calls else {}),
                }
            )
            continue
        for part in parts:
            answer = _field(part, "functionResponse", "function_response")
            if answer:
                call_id = unanswered.pop(0) if unanswered else f"call_{number}_response"
                result = answer.get("response")
                output = result.get("content", result) if isinstance(result, dict) else result
                chat.append(
                    {
                        "role": "tool",
                        "tool_call_id": call_id,
                        "name": answer.get("name"),
                        "content": output if isinstance(output, str) else json.dumps(output),
                    }
                )
        files = [
            _file_part(_field(inline, "mimeType", "mime_type"), inline.get("data"))
            for part in parts
            if isinstance(inline := _field(part, "inlineData", "inline_data"), dict)
        ]
        if files:
            chat.append({"role": "user", "content": [{"type": "text", "text": text}, *files]})
        elif text:
            chat.append({"role": "user", "content": text})
    return chat


def _field(part: Any, *names: str) -> Any:
    """A part's field under either of its names (the API takes camelCase and snake_case alike)."""
    if not isinstance(part, dict):
        return None
    return next((part[name] for name in names if name in part), None)


class GeminiEncoder:
    """``GenerateContentResponse`` objects: a word each, a function call whole."""

    def __init__(self, plan: Plan, model: str, prompt_tokens: int) -> None:
        self.plan, self.model, self.prompt_tokens = plan, model, prompt_tokens
        self.id = f"scripted-{plan.serial}"
        self.sent = 0

    def opening(self) -> list[bytes]:
        return []

    def delta(self, index: int, delta: Json) -> list[bytes]:
        self.sent = index + 1
        if delta.get("content") is not None:
            return [sse(self._response([{"text": delta["content"]}]))]
        following = self.plan.deltas[index + 1] if index + 1 < len(self.plan.deltas) else {}
        if "tool_calls" in following and "id" not in following["tool_calls"][0]:
            return []  # more pieces of this call are due
        return [sse(self._response([self._call(index)]))]

    def _call(self, last: int) -> Json:
        """The function call whose last piece is delta ``last``."""
        first = last
        while "id" not in self.plan.deltas[first]["tool_calls"][0]:
            first -= 1
        pieces = [self.plan.deltas[i]["tool_calls"][0]["function"] for i in range(first, last + 1)]
        arguments = json.loads("".join(p["arguments"] for p in pieces) or "{}")
        return {"functionCall": {"name": pieces[0]["name"], "args": arguments}}

    def _response(self, parts: list[Json], finish: str | None = None) -> Json:
        candidate: Json = {"content": {"parts": parts, "role": "model"}, "index": 0}
        if finish is not None:
            candidate["finishReason"] = finish
        usage = {
            "promptTokenCount": self.prompt_tokens,
            "candidatesTokenCount": self.sent,
            "totalTokenCount": self.prompt_tokens + self.sent,
        }
        return {
            "candidates": [candidate],
            "usageMetadata": usage,
            "modelVersion": self.model,
            "responseId": self.id,
        }

    def closing(self, sent: int, finish: bool) -> list[bytes]:
        return [sse(self._response([{"text": ""}], "STOP" if finish else None))]

    def failure(self, status: int, sent: int) -> list[bytes]:
        return [sse(gemini_error_body(status, f"Scripted failure after {sent} chunks."))]

    def broken(self) -> Json:
        return self._response([{"text": " broken"}])

    def message(self, sent: int) -> Json:
        self.sent = sent
        parts: list[Json] = []
        for index, delta in enumerate(self.plan.deltas):
            if delta.get("content") is not None:
                if not parts or "text" not in parts[-1]:
                    parts.append({"text": ""})
                parts[-1]["text"] += delta["content"]
            elif index + 1 == len(self.plan.deltas) or "id" in self.plan.deltas[index + 1]["tool_calls"][0]:
                parts.append(self._call(index))
        return self._response(parts, "STOP")


def gemini_error_body(status: int, message: str) -> Json:
    return {"error": {"code": status, "message": message, "status": GEMINI_STATUSES.get(status, "UNKNOWN")}}


def gemini_error(fault: EarlyFault) -> web.Response:
    overflow = "The input token count ({tokens}) exceeds the maximum number of tokens allowed ({window})."
    message = fault_message(fault, overflow, GEMINI_MESSAGES)
    return web.json_response(gemini_error_body(fault.status, message), status=fault.status)


async def gemini_generate(request: web.Request) -> web.StreamResponse:
    model, _, method = request.match_info["target"].partition(":")
    if method not in ("streamGenerateContent", "generateContent"):
        return gemini_error(EarlyFault(404))

    def encoder(body: Json, plan: Plan, prompt_tokens: int) -> Encoder:
        return GeminiEncoder(plan, model, prompt_tokens)

    return await _answer(
        request, gemini_messages, encoder, gemini_error, stream=method == "streamGenerateContent"
    )


# -- shared -----------------------------------------------------------------------------------------------


async def _answer(
    request: web.Request,
    to_messages: Callable[[Json], list[Json]],
    make_encoder: Callable[[Json, Plan, int], Encoder],
    render_error: Callable[[EarlyFault], web.Response],
    *,
    stream: bool | None,
) -> web.StreamResponse:
    """Read, plan and answer one request; ``stream`` None: as the body's ``stream`` says."""
    state = request.app[STATE_KEY]
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise BadRequestError("The request body must be a JSON object.")
        messages = to_messages(body)
        plan = plan_reply(messages, next(state.ids))
    except (BadRequestError, ValueError) as exc:
        log.info("%s %s rejected: %s", request.method, request.path, exc)
        return render_error(EarlyFault(400, message=str(exc)))
    note_request(request, body, messages)
    plan = _note_prompt(state, plan, messages)
    streaming = bool(body.get("stream")) if stream is None else stream
    prompt_tokens = count_prompt_tokens(messages)
    log_plan(request, plan, streaming, prompt_tokens)
    early = early_fault(plan, streaming, prompt_tokens)
    if early is not None:
        return render_error(early)
    rate = plan.directives.rate if plan.directives.rate is not None else state.token_rate
    encoder = make_encoder(body, plan, prompt_tokens)
    state.in_flight += 1
    try:
        if streaming:
            return await stream_plan(request, plan, rate, encoder)
        return await complete_plan(request, plan, encoder)
    except (ConnectionResetError, _ConnectionReset):
        return web.Response(status=499)
    finally:
        state.in_flight -= 1


def add_routes(app: web.Application) -> None:
    """Serve the Anthropic Messages API and Gemini's generateContent on ``app`` (a scripted model app)."""
    app.router.add_post("/v1/messages", anthropic_create)
    app.router.add_post("/v1beta/models/{target}", gemini_generate)
