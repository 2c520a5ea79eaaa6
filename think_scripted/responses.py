"""OpenAI's Responses API for the scripted model: background generations and resumable event streams.

:func:`add_routes` puts these routes on the scripted model's app (``build_app`` calls it), so one server
answers both APIs:

* ``POST /v1/responses`` -- ``input`` (a string, or a list of items: messages ``{"role", "content"}``
  whose content is a string or a list of ``input_text`` / ``output_text`` parts, ``function_call`` and
  ``function_call_output`` items), optional ``instructions`` (a system message), ``tools`` (echoed back),
  ``stream``, ``background``, ``store``. The input is turned into chat messages and the reply is the one
  ``/v1/chat/completions`` would give (directives, tool calls, tool-result follow-ups, continuations,
  ``once`` / ``always``, token accounting: see :mod:`think_scripted.server`). A text reply is one
  ``message`` output item streamed one word per ``response.output_text.delta``; ``[tool NAME {json}]``
  gives ``function_call`` output items (``call_id`` ``call_<R>_<i>`` as in the chat API) whose arguments
  come in up to three ``response.function_call_arguments.delta`` events.
* ``GET /v1/responses/{id}`` -- the response object as it stands (``queued``, ``in_progress``,
  ``completed``, ``failed``, ``cancelled``; ``usage`` once it has ended). With ``?stream=true`` it
  replays the stored events whose ``sequence_number`` is greater than ``starting_after`` (all of them
  without it) and then follows the live ones until the response ends.
* ``POST /v1/responses/{id}/cancel`` -- stops a background generation (status ``cancelled``; streams
  following it end without a terminal event). A finished response is returned unchanged; a response
  that is not a background one is a 400.

Every generation runs as a server-side asyncio task that records its events (each with a
``sequence_number`` counting from 0) in memory under the response id. With ``background: true`` the task
is independent of the request: a client that disconnects from the POST's stream can reattach with
``GET ...?stream=true&starting_after=N`` and gets exactly the events it missed. Without it the generation
belongs to the request: a streaming client that leaves cancels it. ``background: true`` requires
``store`` (an HTTP 400 otherwise); ``store: false`` or the directive ``[forget]`` in the prompt drop the
response from the store as soon as it is created (a GET, a resume or a cancel is then a 404, as for an
expired response), although the POST's own stream still runs to its end. An unknown id is a 404 with
OpenAI's error body. ``previous_response_id`` is not supported (HTTP 400).

Faults: ``[overflow]``, ``[window N]`` and ``[fail after 0 with S]`` answer the POST with the HTTP error,
as the chat API does; so does ``[fail after K with S]`` for a POST that neither streams nor runs in the
background. Otherwise ``[fail after K with S]`` ends the generation after K chunks with status
``failed``, an ``error`` (code ``rate_limit_exceeded`` for 429, else ``server_error``) and a
``response.failed`` event; ``[stall after K]`` leaves it ``in_progress`` for ever after K chunks (a
cancel or the server's shutdown ends it). ``[reset after K]`` and ``[malformed after K]`` break only the
POST's own event stream (after the event that carries chunk K, or before ``response.completed`` if the
reply has exactly K chunks): the stored generation carries on, and a GET resume is never broken. A chunk is a
text word or a tool-call piece (its first ``output_item.added`` or an arguments delta), counted in the
response's ``usage.output_tokens``; ``usage.input_tokens`` is the chat API's ``prompt_tokens``.

Accounting for tests (:class:`ResponsesState`, also on ``ScriptedModelServer``): ``created`` counts the
generations started, ``output_tokens`` maps each response id to the chunks generated for it so far.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from think_scripted.server import (
    MODEL_NAME,
    STATE_KEY,
    BadRequestError,
    Json,
    Plan,
    ServerState,
    _early_error,
    _error_response,
    _note_prompt,
    _prompt_index,
    _reset,
    count_prompt_tokens,
    error_body,
    message_text,
    pace,
    plan_reply,
)

log = logging.getLogger("think_scripted.server.responses")

_FORGET_RE = re.compile(r"\[forget\]", re.IGNORECASE)
FINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "incomplete"})
_POLL_S = 0.1  # how often a waiting stream looks for a departed client or a closing server
FILE_PARTS = ("input_image", "input_file")  # kept as parts: [files] reads them (think_scripted.server)


@dataclass
class Generation:
    """One response: its state as it stands and every event it has produced, in order."""

    id: str
    serial: int
    model: str
    background: bool
    input_tokens: int
    instructions: str | None = None
    tools: list[Any] = field(default_factory=list)
    status: str = "queued"
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[Json] = field(default_factory=list)
    events: list[Json] = field(default_factory=list)
    produced: list[int] = field(default_factory=list)  # chunks generated when each event was recorded
    chunks: int = 0
    error: Json | None = None
    task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in FINAL_STATUSES

    def snapshot(self) -> Json:
        """The response object as it stands (a copy)."""
        usage = None
        if self.finished:
            i, o = self.input_tokens, self.chunks
            usage = {
                "input_tokens": i,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": o,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": i + o,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": self.background,
            "error": copy.deepcopy(self.error),
            "incomplete_details": None,
            "instructions": self.instructions,
            "max_output_tokens": None,
            "metadata": {},
            "model": self.model,
            "output": copy.deepcopy(self.output),
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": copy.deepcopy(self.tools),
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
        }

    def emit(self, kind: str, **fields: Any) -> None:
        """Record the next event (its ``sequence_number`` is its index) and wake the streams following."""
        event = {"type": kind, "sequence_number": len(self.events), **copy.deepcopy(fields)}
        self.events.append(event)
        self.produced.append(self.chunks)
        self.notify()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float) -> bool:
        """Wait for the next event or status change; False if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        return True


@dataclass
class ResponsesState:
    """The Responses API side of one app: stored responses, running generations and accounting."""

    responses: dict[str, Generation] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    requests: list[Json] = field(default_factory=list)  # bodies of POST /v1/responses, oldest first
    created: int = 0  # generations started
    output_tokens: dict[str, int] = field(default_factory=dict)  # chunks generated per response id


RESPONSES_KEY = web.AppKey("scripted_responses_state", ResponsesState)


def input_messages(body: Json) -> list[Json]:
    """The chat messages equivalent to a Responses request's ``instructions`` and ``input``."""
    messages: list[Json] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise BadRequestError("'input' must be a string or a non-empty list of input items.")
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = str(item.get("role") or "user").replace("developer", "system")
            content = item.get("content")
            files = isinstance(content, list) and any(p.get("type") in FILE_PARTS for p in content)
            messages.append({"role": role, "content": content if files else message_text(item)})
        elif kind == "function_call":
            function = {"name": str(item.get("name") or ""), "arguments": str(item.get("arguments") or "")}
            call = {"id": item.get("call_id"), "type": "function", "function": function}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and last.get("tool_calls") and last.get("content") is None:
                last["tool_calls"].append(call)  # consecutive calls are one parallel step
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else message_text({"content": output})
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
    return messages


def _forgets(plan: Plan, messages: list[Json]) -> bool:
    prompt = _prompt_index(messages)
    return not plan.summary and prompt >= 0 and bool(_FORGET_RE.search(message_text(messages[prompt])))


class _Writer:
    """Turns the plan's deltas into output items and their events."""

    def __init__(self, generation: Generation, stamp: bool) -> None:
        self.generation, self.stamp = generation, stamp
        self.open: Json | None = None

    def _add(self, item: Json) -> None:
        self.close()
        self.generation.output.append(item)
        self.open = item
        self.generation.emit("response.output_item.added", output_index=self._index, item=item)

    @property
    def _index(self) -> int:
        return len(self.generation.output) - 1

    def open_message(self) -> Json:
        if self.open is None or self.open["type"] != "message":
            item: Json = {"id": f"msg_scripted_{self.generation.serial}_{len(self.generation.output)}"}
            item |= {"type": "message", "role": "assistant", "status": "in_progress", "content": []}
            self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            self._emit_part("response.content_part.added", item, part)
        assert self.open is not None
        return self.open

    def _emit_part(self, kind: str, item: Json, part: Json) -> None:
        ids = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
        self.generation.emit(kind, **ids, part=part)

    def apply(self, delta: Json) -> None:
        if "content" in delta:
            text = str(delta["content"])
            if self.stamp and text:
                text = f"{text}@{time.time():.4f}"
            item = self.open_message()
            item["content"][0]["text"] += text
            ids = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
            self.generation.emit("response.output_text.delta", **ids, delta=text, logprobs=[])
            return
        piece = delta["tool_calls"][0]
        function = piece["function"]
        if "id" in piece:  # the first piece of a call: its id and name
            call_id, name = piece["id"], function["name"]
            item_id = f"fc_scripted_{self.generation.serial}_{piece['index']}"
            fields = {"call_id": call_id, "name": name, "arguments": "", "status": "in_progress"}
            self._add({"id": item_id, "type": "function_call", **fields})
            return
        assert self.open is not None
        self.open["arguments"] += function["arguments"]
        ids = {"item_id": self.open["id"], "output_index": self._index}
        self.generation.emit("response.function_call_arguments.delta", **ids, delta=function["arguments"])

    def close(self) -> None:
        """Finish the open output item, if any."""
        item, self.open = self.open, None
        if item is None:
            return
        emit, index = self.generation.emit, self._index
        if item["type"] == "message":
            part = item["content"][0]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            emit("response.output_text.done", **ids, text=part["text"], logprobs=[])
            emit("response.content_part.done", **ids, part=part)
        else:
            ids = {"item_id": item["id"], "output_index": index}
            emit("response.function_call_arguments.done", **ids, arguments=item["arguments"])
        item["status"] = "completed"
        emit("response.output_item.done", output_index=index, item=item)


async def _generate(
    state: ResponsesState, server: ServerState, generation: Generation, plan: Plan, rate: float
) -> None:
    """Produce the generation's events, paced at ``rate`` chunks per second, until it ends."""
    writer = _Writer(generation, plan.directives.stamp)
    try:
        generation.status = "in_progress"
        generation.emit("response.in_progress", response=generation.snapshot())
        if plan.finish_reason == "stop":
            writer.open_message()
        for sent in range(len(plan.deltas) + 1):
            if plan.fires(plan.directives.stall, sent):
                log.info("response %s: stalling after %d chunks", generation.id, sent)
                await asyncio.Event().wait()  # until cancelled
            fail = plan.active(plan.directives.fail)
            if fail is not None and fail.after == sent:
                code = "rate_limit_exceeded" if fail.status == 429 else "server_error"
                generation.error = {"code": code, "message": f"Scripted failure after {sent} chunks."}
                generation.status = "failed"
                generation.emit("response.failed", response=generation.snapshot())
                return
            if sent == len(plan.deltas):
                break
            await pace(server, rate)
            generation.chunks += 1
            state.output_tokens[generation.id] = generation.chunks
            writer.apply(plan.deltas[sent])
        writer.close()
        generation.status = "completed"
        generation.emit("response.completed", response=generation.snapshot())
    except asyncio.CancelledError:
        if not generation.finished:
            generation.status = "cancelled"
            generation.notify()
        raise


def _start(request: web.Request, body: Json, plan: Plan, messages: list[Json], *, store: bool) -> Generation:
    """Create the response, store it (unless it is to be forgotten) and start its generation task."""
    state, responses = request.app[STATE_KEY], request.app[RESPONSES_KEY]
    background = bool(body.get("background"))
    instructions = body.get("instructions")
    generation = Generation(
        id=f"resp_scripted_{plan.serial}",
        serial=plan.serial,
        model=str(body.get("model") or MODEL_NAME),
        background=background,
        input_tokens=count_prompt_tokens(messages),
        instructions=instructions if isinstance(instructions, str) else None,
        tools=list(body.get("tools") or []),
        status="queued" if background else "in_progress",
    )
    responses.created += 1
    responses.output_tokens[generation.id] = 0
    if store and not _forgets(plan, messages):
        responses.responses[generation.id] = generation
    generation.emit("response.created", response=generation.snapshot())
    rate = plan.directives.rate if plan.directives.rate is not None else state.token_rate
    task = asyncio.get_running_loop().create_task(_generate(responses, state, generation, plan, rate))
    generation.task = task
    responses.tasks.add(task)
    task.add_done_callback(responses.tasks.discard)
    return generation


def _gone(request: web.Request) -> bool:
    """The client left or the server is shutting down."""
    transport = request.transport
    return transport is None or transport.is_closing() or request.app[STATE_KEY].closing.is_set()


def _sse(event: Json) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _transport_fault(plan: Plan | None, generation: Generation, index: int) -> str | None:
    """``"reset"`` or ``"malformed"`` if that fault is due before sending event ``index`` (POST only)."""
    for name in ("reset", "malformed"):
        fault = plan.active(getattr(plan.directives, name)) if plan is not None else None
        if fault is None:
            continue
        produced, kind = generation.produced[index], generation.events[index]["type"]
        if produced > fault.after or (produced == fault.after and kind == "response.completed"):
            return name
    return None


async def _stream(
    request: web.Request, generation: Generation, after: int, plan: Plan | None = None, *, owner: bool = False
) -> web.StreamResponse:
    """Send the events after sequence number ``after``, then the live ones until the response ends.

    ``plan`` (the POST's own stream) applies its transport faults; ``owner`` cancels the generation if
    the client leaves before it ends (a response that is not a background one).
    """
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    index = max(after + 1, 0)
    try:
        while True:
            while index < len(generation.events):
                fault = _transport_fault(plan, generation, index)
                if fault == "reset":
                    _reset(request, generation.produced[index - 1] if index else 0)
                    return response
                if fault == "malformed":
                    whole = _sse(generation.events[index])
                    await response.write(whole[: len(whole) // 2] + b"\n\n")
                    await response.write_eof()
                    return response
                await response.write(_sse(generation.events[index]))
                index += 1
            if generation.finished and index >= len(generation.events):
                break
            if not await generation.changed(_POLL_S) and _gone(request):
                log.info("%s %s: the client left after event %d", request.method, request.path, index - 1)
                return response
        await response.write_eof()
    except ConnectionResetError:
        log.info("%s %s: client went away", request.method, request.path)
    finally:
        if owner and not generation.finished and generation.task is not None:
            generation.task.cancel()
    return response


async def _wait(request: web.Request, generation: Generation) -> web.StreamResponse:
    """The whole response once it has ended (a stalled one: until the client leaves, then a 499)."""
    while not generation.finished:
        if not await generation.changed(_POLL_S) and _gone(request):
            if generation.task is not None:
                generation.task.cancel()
            return web.Response(status=499)
    return web.json_response(generation.snapshot())


def _not_found(response_id: str) -> web.Response:
    message = f"Response with id '{response_id}' not found."
    return _error_response(404, error_body(message, "invalid_request_error", None))


async def _read_body(request: web.Request) -> Json:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"Request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    if body.get("previous_response_id"):
        raise BadRequestError(
            "'previous_response_id' is not supported by the scripted model: send the whole input."
        )
    if body.get("background") and body.get("store") is False:
        raise BadRequestError("Background mode requires 'store' to be true.")
    return body


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        body = await _read_body(request)
        messages = input_messages(body)
        plan = plan_reply(messages, next(state.ids))
    except BadRequestError as exc:
        log.info("%s %s rejected: %s", request.method, request.path, exc)
        return _error_response(400, error_body(str(exc), "invalid_request_error", None))
    request.app[RESPONSES_KEY].requests.append(body)
    plan = _note_prompt(state, plan, messages)
    stream, background = bool(body.get("stream")), bool(body.get("background"))
    log.info(
        "%s %s stream=%s background=%s follow_up=%s directives: %s",
        request.method,
        request.path,
        stream,
        background,
        plan.follow_up,
        "summarisation request" if plan.summary else plan.directives.summary(),
    )
    early = _early_error(plan, stream or background, count_prompt_tokens(messages))
    if early is not None:
        return early
    generation = _start(request, body, plan, messages, store=body.get("store") is not False)
    if stream:
        return await _stream(request, generation, -1, plan, owner=not background)
    if background:
        return web.json_response(generation.snapshot())
    return await _wait(request, generation)


def _lookup(request: web.Request) -> Generation | None:
    return request.app[RESPONSES_KEY].responses.get(request.match_info["response_id"])


async def retrieve_response(request: web.Request) -> web.StreamResponse:
    generation = _lookup(request)
    log.info("%s %s %s", request.method, request.path, dict(request.query))
    if generation is None:
        return _not_found(request.match_info["response_id"])
    if request.query.get("stream", "").lower() != "true":
        return web.json_response(generation.snapshot())
    raw = request.query.get("starting_after", "-1")
    try:
        after = int(raw)
    except ValueError:
        message = f"'starting_after' must be an integer, got {raw!r}."
        return _error_response(400, error_body(message, "invalid_request_error", None, "starting_after"))
    return await _stream(request, generation, after)


async def cancel_response(request: web.Request) -> web.Response:
    generation = _lookup(request)
    log.info("%s %s", request.method, request.path)
    if generation is None:
        return _not_found(request.match_info["response_id"])
    if not generation.background:
        message = "Only responses created with background=true can be cancelled."
        return _error_response(400, error_body(message, "invalid_request_error", None))
    if not generation.finished:
        if generation.task is not None:
            generation.task.cancel()
        generation.status = "cancelled"
        generation.notify()
    return web.json_response(generation.snapshot())


async def _cancel_generations(app: web.Application) -> None:
    tasks = list(app[RESPONSES_KEY].tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def add_routes(app: web.Application) -> None:
    """Serve the Responses API on ``app`` (a scripted model app, see ``build_app``)."""
    app[RESPONSES_KEY] = ResponsesState()
    app.on_shutdown.append(_cancel_generations)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
