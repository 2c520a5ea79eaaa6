"""A deterministic, scriptable OpenAI-compatible chat model server.

It is the offline default model of the demo and the model of the test suite, reached through litellm's
real OpenAI code path (model ``"openai/scripted"``, ``api_base`` = this server's ``/v1`` URL).

Endpoints: ``POST /v1/chat/completions`` (``stream`` true or false), ``GET /v1/models``, ``GET /healthz``,
the Responses API (``/v1/responses``, see below), and the same replies in Anthropic's Messages API
(``POST /v1/messages``) and Gemini's ``generateContent`` (``POST
/v1beta/models/{model}:streamGenerateContent``): see :mod:`think_scripted.dialects`;
``think_scripted.kwargs.litellm_kwargs(url, dialect)`` gives litellm's arguments for each.
The reply is driven by the *prompt*: the last user message of the request that is not a continuation
prompt (summarisation requests excepted, see below). Directives in it (case-insensitive, anywhere in the
text, combinable):

* ``count to N`` -- reply ``1 2 ... N``, one number per chunk (``"1"``, ``" 2"``, ...). N above
  ``SCRIPTED_MODEL_MAX_CHUNKS`` (20,000) is refused with an HTTP 400: the reply is built in memory.
* ``[rate R]`` -- pace this reply at R chunks per second (``R <= 0``: as fast as possible).
* ``[stall after K]`` -- after K content chunks stop sending but keep the connection open until the
  client goes away (the response never ends). ``K=0`` stalls right after the role chunk.
* ``[fail after K with STATUS]`` -- ``K=0``: answer with HTTP STATUS and an OpenAI error body (429 is a
  ``rate_limit_error``, 5xx a ``server_error``). ``K>0``: stream K chunks, then an SSE ``data:`` line
  holding ``{"error": {...}}`` and end the stream without ``[DONE]``. Non-streaming requests get the
  HTTP error whenever the fault is reached. A 429 (before content) carries ``Retry-After: 1``.
* ``[error says TEXT]`` -- the message of the error a ``[fail ...]`` sends (Chat Completions: the HTTP
  error body and the in-stream error event) is TEXT, as a provider behind a proxy may name its internal
  hosts there.
* ``[malformed after K]`` -- stream K chunks, then an SSE ``data:`` line that is not valid JSON (a chunk
  cut off mid-object), and end the stream without ``[DONE]``. ``K=0``: right after the role chunk.
  Non-streaming requests get a 200 whose body is that broken JSON.
* ``[reset after K]`` -- stream K chunks, then close the TCP connection abruptly (a reset: ``SO_LINGER``
  0), without finishing the chunked response. ``K=0``: right after the role chunk. Non-streaming
  requests are reset before any response.
* ``[eof after K]`` -- stream K chunks, then end the response cleanly, without a finish reason or an end
  marker (``[DONE]``): a stream cut short by a proxy that closes politely. Non-streaming requests get the
  broken JSON of ``[malformed ...]``.
* ``[no finish]`` -- the whole reply, and its end marker, but never the finish reason (a provider that
  leaves it out).
* ``[overflow]`` -- HTTP 400 with OpenAI's ``context_length_exceeded`` body.
* ``[window N]`` (N a whole number >= 1) -- the model's context window: a request whose ``prompt_tokens``
  (see Token accounting) exceed N gets HTTP 400 with OpenAI's ``context_length_exceeded`` body (type
  ``invalid_request_error``, param ``messages``), message ``This model's maximum context length is N
  tokens. However, your messages resulted in M tokens. Please reduce the length of the messages.``
  (M = ``prompt_tokens``), before any content, streaming or not; a request within the window is answered
  normally. It is a property of the model, not a fault: it applies to every request whose prompt carries
  it, continuations and tool-result follow-ups included, and takes no ``once`` / ``always``. Any other
  value (``[window 0]``, ``[window -1]``, ``[window 2.5]``, a bare ``[window]``, a missing ``]``) makes the
  request an HTTP 400 ``invalid_request_error`` naming the directive.
* ``[tool NAME {json}]`` -- answer with a call of tool NAME with these JSON arguments (``{}`` if omitted),
  finish reason ``tool_calls`` (this wins over ``count to N`` until the tool results are in). Several
  ``[tool ...]`` directives make ONE assistant step of parallel calls in prompt order: call i has
  ``index`` i, its own id, and its own deltas (first id and name, then the arguments in up to three
  pieces; all of call 0, then all of call 1, ...); the non-streaming message lists them all. Call ids
  are ``call_<R>_<i>``, R being the response number of the server (also in the response id
  ``chatcmpl-scripted-<R>``), so they are unique across all responses of one server.
* ``[tool NAME {json} times K]`` (K a whole number >= 1; without it K = 1) -- after each batch of results,
  call again (one parallel step, prompt order) every tool directive that has fewer than K results after
  the prompt; the follow-up text below comes once every directive has its K. A ``role: "tool"`` message
  is a result of tool NAME where NAME is: the name of the call its ``tool_call_id`` answers (searched in
  all messages, latest first), else the first tool directive's name, else the message's ``name``. When
  several directives share NAME, the result counts for the first of them whose JSON arguments equal
  its call's (parsed, so re-serialized arguments match), else for the first of them. A ``times`` that is
  not a whole number >= 1 (``times 0``, ``times x``, a bare ``times``), invalid JSON arguments or a
  missing ``]`` make the request an HTTP 400 ``invalid_request_error`` naming the directive.
* ``[tool NAME {json} then {json2} ...]`` -- a model that corrects its input: the first call has the
  first arguments; once it has a result, the next call has the next arguments, and so on (``times`` is
  the number of argument objects, and the two cannot be combined). Its results count for it whichever
  arguments their call had.
* tool results -- once ``role: "tool"`` messages follow the prompt and no directive needs more results,
  the reply is text built from the LATEST batch: the tool messages after the last assistant message with
  ``tool_calls`` before the last tool message (all tool messages after the prompt if there is none), in
  message order, each as ``Tool NAME returned: <content>``, joined by ``"; "``. If the prompt also says
  ``count to N``, the words ``" 1" " 2" ... " N"`` follow (a long, rate-paced answer after a result).
* ``[story]`` -- reply with a short story in sentences (``STORY``), for continuations of prose.
* ``[repeat N]``, ``[restart]``, ``[restart all]`` -- the habits of real models asked to continue: a
  continuation of a ``[story]`` (or of the fixed reply) begins N words before where the previous response
  stopped, at the start of the sentence it stopped in, or at the very start of the answer with no space
  before it; a ``count to N`` continuation repeats the last N numbers. Only continuations are affected.
* ``[files]`` -- reply ``Files: `` and the files the prompt carries, ``; ``-separated, each as ``TYPE N
  bytes sha256 HEX`` (the first 16 hex digits of its SHA-256) and `` named NAME`` when the part names
  it, or ``none``: the chat API's ``image_url`` and ``file`` parts and the Responses API's
  ``input_image`` and ``input_file``, with base64 data URLs (Anthropic's ``image`` / ``document`` blocks
  and Gemini's ``inlineData`` are read as these). Text a client attached goes to a model as text, so it is
  part of the prompt and not listed. A file part whose data cannot be read makes the request a 400.
* anything else -- the fixed reply ``Hello! I am the scripted model. Ask me to count to N.``
Text replies are streamed word by word (every chunk but the first carries its leading space). A fault
fires once K content chunks were sent; a reply with fewer than K chunks completes normally.

Continuations: a request is a continuation when its last message is an assistant message, or a user
message starting with ``Continue your previous response`` right after an assistant message. The reply
then resumes where the assistant messages following the prompt (and following the last tool result, if
any) left off: ``count to N`` carries on from the last integer found in them + 1 (``" 18"``, ...; nothing
but the stop chunk if already at N); text replies (tool-result follow-ups included, their numbers too)
skip as many words as were already sent.

Any request with messages after the prompt (a continuation or a tool-result follow-up) does NOT re-apply
``[stall ...]``, ``[fail ...]``, ``[malformed ...]``, ``[reset ...]``, ``[eof ...]``, ``[no finish]`` or
``[overflow]``, unless the
directive ends with ``always``: ``[stall after K always]`` stalls every continuation after K *more*
chunks, and likewise ``[fail after K with STATUS always]``, ``[malformed after K always]``, ``[reset after
K always]`` and ``[overflow always]``. The suffix ``once`` (``[stall after K once]``) fires the fault only
on the first request that is not a follow-up and carries that exact prompt message (its JSON, compared
over the server's lifetime: put a unique word in prompts that servers share), so a retry of the same user
turn goes through; its continuations do not re-apply it either. ``[window N]`` is not a fault and applies
to every request (see above).
``[stamp]`` appends ``@<unix time>`` to every content delta when it is sent, so a client on the same
machine can measure model-to-client latency per chunk.

Summarisation requests: a request with a ``system`` message whose content contains :data:`SUMMARY_MARKER`
(``Summarize the conversation below``) is a summarisation request. No directives are parsed from any of
its messages (the transcript being summarised may well hold ``[overflow]``, ``[window N]``, ``count to N``
or ``[tool ...]`` text), so it never faults and is never window-checked. Its reply is exactly ``Summary of
K lines.``, K being the number of non-empty lines (whitespace-only lines count as empty) in the content of
the last ``user`` message of the request (0 if there is none); it is streamed word by word like other text
replies (or returned whole when not streaming), is never a continuation, and is recorded in the request
log like any other request.

``[cached N]`` reports N of the prompt tokens (at most all of them) as read from the prompt cache
(``usage.prompt_tokens_details.cached_tokens``, Chat Completions only).

Token accounting: ``prompt_tokens = ceil(characters of all message text / 4) + 4 per message`` (files
count nothing); tool call names and arguments count as message characters; ``completion_tokens`` =
number of content chunks (text or tool-call deltas). The usage chunk (``choices: []``) is sent when the
request asks for ``stream_options.include_usage``. Error responses carry ``x-should-retry: false`` so
the OpenAI SDK does not retry them itself: retries are the caller's business.

Responses API (:mod:`think_scripted.responses`, on the same server): ``POST /v1/responses``
answers the same prompts with OpenAI's Responses events (``sequence_number`` from 0, one
``response.output_text.delta`` per word, ``function_call`` items for ``[tool ...]``). With ``background:
true`` the generation is a server-side task that outlives the request: ``GET /v1/responses/{id}`` returns
the response as it stands, ``GET /v1/responses/{id}?stream=true&starting_after=N`` replays the events after
N and follows the live ones, ``POST /v1/responses/{id}/cancel`` stops it. ``[forget]`` in the prompt drops
the stored response at once (a later GET or resume is a 404, as for an expired one). The server counts
the generations it started and the output tokens of each (``ScriptedModelServer.responses_created``,
``.response_output_tokens``). That module's docstring has the details and how faults apply.

Size: a request body may be up to ``SCRIPTED_MODEL_MAX_BODY_BYTES`` (default 64 MiB; aiohttp's own
default, 1 MiB, refused the history of a long conversation before any context window could). The
context window: run as a command (``python -m think_scripted.server``, the demo's model) the server
declares one of ``SCRIPTED_MODEL_CONTEXT_WINDOW`` tokens (default
:data:`think_scripted.kwargs.CONTEXT_WINDOW`, 128,000; ``0``: none), and answers every request over it
(summarisation requests excepted) as ``[window N]`` does, as a real provider answers a prompt over its
window. ``build_app()`` and :class:`ScriptedModelServer` declare none unless given ``context_window``;
a ``[window N]`` in the prompt wins.

Pacing: ``SCRIPTED_MODEL_TOKEN_RATE`` chunks per second (default 20; ``<= 0``: no pacing), overridden by
``build_app(token_rate=...)`` and by ``[rate R]``.
Run: ``python -m think_scripted.server --host 127.0.0.1 --port 8765`` (defaults from
``SCRIPTED_MODEL_HOST`` / ``SCRIPTED_MODEL_PORT``). In tests use :class:`ScriptedModelServer`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from aiohttp import web

from think_scripted.kwargs import CONTEXT_WINDOW

log = logging.getLogger("think_scripted.server")

MODEL_NAME = "scripted"
FIXED_REPLY = "Hello! I am the scripted model. Ask me to count to N."
# ``[story]``: prose in sentences, for the habits a continuation must survive ([repeat N], [restart]).
STORY = (
    "The robot was built to help artists. It mixed paints at night and cleaned brushes at dawn. "
    "One morning it found a blank canvas by the window. Nobody had asked it to paint, so it waited. "
    "By noon the light had moved across the floor. The robot picked up a brush and drew a single line. "
    "It was crooked, and the robot liked it. The artists came back in the evening and said nothing. "
    "The next day they left two canvases by the window."
)
CONTINUE_PREFIX = "Continue your previous response"
DEFAULT_TOKEN_RATE = 20.0
RATE_LIMIT_RETRY_AFTER_S = 1  # the Retry-After of a scripted 429
SUMMARY_MARKER = "Summarize the conversation below"


def context_length_message(limit: int, tokens: int) -> str:
    """OpenAI's ``context_length_exceeded`` message for a window of ``limit`` and a prompt of ``tokens``."""
    return (
        f"This model's maximum context length is {limit} tokens. However, your messages resulted in {tokens} "
        "tokens. Please reduce the length of the messages."
    )


OVERFLOW_WINDOW = (128000, 130000)  # the window and prompt tokens an ``[overflow]`` reports
OVERFLOW_MESSAGE = context_length_message(*OVERFLOW_WINDOW)

Json = dict[str, Any]

# The longest ``count to N`` the server builds (a reply is built whole, in memory, before it is sent).
MAX_CHUNKS = int(os.environ.get("SCRIPTED_MODEL_MAX_CHUNKS", "") or 20_000)
_COUNT_RE = re.compile(r"\bcount to\s+(\d+)", re.IGNORECASE)
_CACHED_RE = re.compile(r"\[cached\s+(\d+)\s*\]", re.IGNORECASE)
_RATE_RE = re.compile(r"\[rate\s+(-?\d+(?:\.\d*)?)\s*\]", re.IGNORECASE)
_STALL_RE = re.compile(r"\[stall after\s+(\d+)(\s+always|\s+once)?\s*\]", re.IGNORECASE)
_FAIL_RE = re.compile(r"\[fail after\s+(\d+)\s+with\s+(\d{3})(\s+always|\s+once)?\s*\]", re.IGNORECASE)
_MALFORMED_RE = re.compile(r"\[malformed after\s+(\d+)(\s+always|\s+once)?\s*\]", re.IGNORECASE)
_EOF_RE = re.compile(r"\[eof after\s+(\d+)(\s+always|\s+once)?\s*\]", re.IGNORECASE)
_RESET_RE = re.compile(r"\[reset after\s+(\d+)(\s+always|\s+once)?\s*\]", re.IGNORECASE)
_OVERFLOW_RE = re.compile(r"\[overflow(\s+always|\s+once)?\s*\]", re.IGNORECASE)
_SAYS_RE = re.compile(r"\[error says\s+([^\]]*?)\s*\]", re.IGNORECASE)
_STAMP_RE = re.compile(r"\[stamp\]", re.IGNORECASE)
_NO_FINISH_RE = re.compile(r"\[no finish(\s+always|\s+once)?\s*\]", re.IGNORECASE)
_FILES_RE = re.compile(r"\[files\]", re.IGNORECASE)
_DATA_URL_RE = re.compile(r"data:([\w.+-]+/[\w.+-]+)(?:;[^,]*)?;base64,(.*)", re.DOTALL)
_WINDOW_RE = re.compile(r"\[window\b\s*([^\]\s]*)\s*(\])?", re.IGNORECASE)
_TOOL_RE = re.compile(r"\[tool\s+([A-Za-z_][\w.-]*)\s*", re.IGNORECASE)
_THEN_RE = re.compile(r"\s*then\s+(?=\{)", re.IGNORECASE)
_TOOL_END_RE = re.compile(r"\s*(?:times\b\s*([^\]\s]*)\s*)?\]", re.IGNORECASE)
_INT_RE = re.compile(r"\d+")
_STORY_RE = re.compile(r"\[story\]", re.IGNORECASE)
_REPEAT_RE = re.compile(r"\[repeat (\d+)\]", re.IGNORECASE)
_RESTART_RE = re.compile(r"\[restart(?: (sentence|all))?\]", re.IGNORECASE)
_WORD_RE = re.compile(r"\s*\S+")


@dataclass
class ServerState:
    """Mutable state of one app: its pacing and what it has seen (read by tests)."""

    token_rate: float
    context_window: int | None = None  # the window every request is held to (a prompt's [window N] wins)
    requests: list[Json] = field(default_factory=list)
    chats: list[list[Json]] = field(default_factory=list)  # each request's messages, in the chat API's form
    clients: list[str] = field(default_factory=list)  # the User-Agent of each request, in order
    in_flight: int = 0
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    prompts: set[str] = field(default_factory=set)
    # Set by ScriptedModelServer.hurry(): paced replies and generations send what is left at once (a
    # test that needs a long stream only until it has killed what it kills).
    hurry: asyncio.Event = field(default_factory=asyncio.Event)


STATE_KEY = web.AppKey("scripted_model_state", ServerState)


class BadRequestError(ValueError):
    """The request or a directive in its prompt cannot be understood (HTTP 400)."""


@dataclass(frozen=True)
class Fault:
    after: int
    always: bool
    status: int = 0
    once: bool = False  # only the first request that carries this prompt (not its retries)

    def __str__(self) -> str:
        return (
            f"after {self.after}"
            + (f" with {self.status}" if self.status else "")
            + " always" * self.always
            + " once" * self.once
        )


@dataclass(frozen=True)
class ToolDirective:
    """One ``[tool NAME {json} times K]``: call NAME with ``arguments`` until it has ``times`` results."""

    name: str
    arguments: str = "{}"
    times: int = 1
    later: tuple[str, ...] = ()  # ``then {json}``: the arguments of the second call, the third, ...

    def __str__(self) -> str:
        if self.later:
            return f"{self.name} {self.arguments}" + "".join(f" then {a}" for a in self.later)
        return f"{self.name} {self.arguments}" + (f" times {self.times}" if self.times != 1 else "")

    def call(self, results: int) -> ToolDirective:
        """The directive as its next call makes it, after `results` results."""
        if not self.later or results == 0:
            return self
        return dataclasses.replace(self, arguments=self.later[min(results, len(self.later)) - 1])

    def all_arguments(self) -> list[Any]:
        return [json.loads(a) for a in (self.arguments, *self.later)]


@dataclass(frozen=True)
class Directives:
    count_to: int | None = None
    rate: float | None = None
    stall: Fault | None = None
    fail: Fault | None = None
    overflow: Fault | None = None
    tools: tuple[ToolDirective, ...] = ()  # in prompt order; several = parallel calls
    stamp: bool = False  # append "@<send time>" to each content delta (latency benchmarks)
    window: int | None = None  # the context window: more prompt tokens than this is an overflow
    malformed: Fault | None = None  # a data line that is not JSON, then the end of the stream
    reset: Fault | None = None  # the connection is reset mid-response
    no_finish: Fault | None = None  # the stream ends without its finish reason
    eof: Fault | None = None  # the stream ends cleanly mid-reply: no finish reason, no end marker
    cached: int | None = None  # of the prompt tokens, this many reported as read from the prompt cache
    error_says: str | None = None  # the message of a [fail ...] error instead of the standard one
    files: bool = False  # describe the files the prompt carries
    story: bool = False  # reply with STORY
    # A continuation's habit: repeat this many words already sent, or restart ("sentence": the one it
    # was in; "all": the whole answer, glued on with no space)
    repeat: int | None = None
    restart: str | None = None

    @property
    def default_tool_name(self) -> str | None:
        return self.tools[0].name if self.tools else None

    def summary(self) -> str:
        items = [(k, v) for k, v in vars(self).items() if v is not None and v != ()]
        return ", ".join(f"{k}={'; '.join(map(str, v)) if k == 'tools' else v}" for k, v in items) or "none"


@dataclass(frozen=True)
class Plan:
    """What to answer: content deltas (text or tool-call pieces) plus the faults that apply."""

    deltas: list[Json]
    finish_reason: str
    directives: Directives
    follow_up: bool
    repeat: bool = False  # this prompt was seen before (a retry of the same turn)
    serial: int = 0  # the response number: in the response id and the tool call ids
    summary: bool = False  # a summarisation request: no directives, never a fault

    def active(self, fault: Fault | None) -> Fault | None:
        if fault is None:
            return None
        if fault.always:
            return fault
        return fault if not self.follow_up and not (fault.once and self.repeat) else None

    def fires(self, fault: Fault | None, sent: int) -> bool:
        fault = self.active(fault)
        return fault is not None and fault.after == sent


def message_text(message: Json) -> str:
    """The text of a message whose content is a string, a list of content parts or null."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _file_of(part: Json) -> tuple[Any, Any]:
    """The data URL and file name of a content part that carries a file (None, None for any other)."""
    kind = part.get("type")
    if kind == "image_url":
        image = part.get("image_url")
        return (image.get("url") if isinstance(image, dict) else image), None
    if kind == "input_image":
        return part.get("image_url"), None
    if kind == "file":
        file = part.get("file")
        return (file.get("file_data"), file.get("filename")) if isinstance(file, dict) else (None, None)
    if kind == "input_file":
        return part.get("file_data"), part.get("filename")
    return None, None


def attachments(message: Json) -> list[tuple[str, bytes, str | None]]:
    """The files a message carries as (media type, bytes, file name): the chat API's ``image_url`` and
    ``file`` parts and the Responses API's ``input_image`` and ``input_file``, with base64 data URLs
    (Anthropic's and Gemini's blocks arrive as these, think_scripted.dialects). A part whose data URL
    cannot be read is a 400."""
    content = message.get("content")
    found: list[tuple[str, bytes, str | None]] = []
    for part in content if isinstance(content, list) else ():
        url, name = _file_of(part) if isinstance(part, dict) else (None, None)
        if url is None:
            continue
        match = _DATA_URL_RE.fullmatch(str(url))
        if match is None:
            raise BadRequestError(f"a file part must carry a base64 data URL, got {str(url)[:40]!r}")
        try:
            data = base64.b64decode(match.group(2), validate=True)
        except ValueError as exc:
            raise BadRequestError(f"a file part's base64 cannot be read: {exc}") from exc
        found.append((match.group(1), data, name if isinstance(name, str) else None))
    return found


def describe_files(message: Json) -> str:
    """The ``[files]`` reply: each file of the prompt as ``TYPE N bytes sha256 HEX16``, or ``none``."""
    described = [
        f"{media} {len(data)} bytes sha256 {hashlib.sha256(data).hexdigest()[:16]}"
        + (f" named {name}" if name else "")
        for media, data, name in attachments(message)
    ]
    return "Files: " + ("; ".join(described) if described else "none")


def _make_fault(after: int, mode: str | None, status: int = 0) -> Fault:
    mode = (mode or "").strip().lower()
    return Fault(after, mode == "always", status, once=mode == "once")


def _count_to(match: re.Match[str] | None) -> int | None:
    """The N of ``count to N``, within MAX_CHUNKS: a reply is built whole before it is sent, so one
    message must not make the server build a billion numbers."""
    if match is None:
        return None
    digits = match.group(1)
    if len(digits) > len(str(MAX_CHUNKS)) or int(digits) > MAX_CHUNKS:
        raise BadRequestError(
            f"count to {digits[:20]}{'...' if len(digits) > 20 else ''}: at most {MAX_CHUNKS} numbers"
            " (SCRIPTED_MODEL_MAX_CHUNKS)"
        )
    return int(digits)


def parse_directives(text: str) -> Directives:
    """The directives of a prompt (see the module docstring)."""
    count, rate, stall = _COUNT_RE.search(text), _RATE_RE.search(text), _STALL_RE.search(text)
    fail, overflow = _FAIL_RE.search(text), _OVERFLOW_RE.search(text)
    try:
        return _directives(text, count, rate, stall, fail, overflow)
    except BadRequestError:
        raise
    except ValueError as exc:  # a number too long to read, say
        raise BadRequestError(f"a directive cannot be read: {exc}") from exc


def _directives(text: str, count: Any, rate: Any, stall: Any, fail: Any, overflow: Any) -> Directives:
    return Directives(
        _count_to(count),
        float(rate.group(1)) if rate else None,
        _make_fault(int(stall.group(1)), stall.group(2)) if stall else None,
        _make_fault(int(fail.group(1)), fail.group(3), int(fail.group(2))) if fail else None,
        _make_fault(0, overflow.group(1)) if overflow else None,
        _parse_tools(text),
        bool(_STAMP_RE.search(text)),
        _parse_window(text),
        _parse_fault(_MALFORMED_RE, text),
        _parse_fault(_RESET_RE, text),
        _parse_no_finish(text),
        _parse_fault(_EOF_RE, text),
        int(cached.group(1)) if (cached := _CACHED_RE.search(text)) else None,
        says.group(1) if (says := _SAYS_RE.search(text)) else None,
        bool(_FILES_RE.search(text)),
        bool(_STORY_RE.search(text)),
        int(repeat.group(1)) if (repeat := _REPEAT_RE.search(text)) else None,
        (restart.group(1) or "sentence").lower() if (restart := _RESTART_RE.search(text)) else None,
    )


def _parse_fault(pattern: re.Pattern[str], text: str) -> Fault | None:
    """A ``[NAME after K]`` fault (``always`` / ``once`` allowed) whose regex has groups (K, mode)."""
    match = pattern.search(text)
    return _make_fault(int(match.group(1)), match.group(2)) if match else None


def _parse_no_finish(text: str) -> Fault | None:
    match = _NO_FINISH_RE.search(text)
    return _make_fault(0, match.group(1)) if match else None


def _parse_window(text: str) -> int | None:
    """The N of the first ``[window N]`` directive (None without one)."""
    match = _WINDOW_RE.search(text)
    if match is None:
        return None
    value = match.group(1)
    if not (value.isascii() and value.isdigit() and int(value) >= 1):
        raise BadRequestError(f"[window]: needs a whole number of tokens N >= 1, got {value!r}")
    if match.group(2) is None:
        raise BadRequestError(f"[window {value}]: expected ']' after the number of tokens")
    return int(value)


def _parse_tools(text: str) -> tuple[ToolDirective, ...]:
    """Every ``[tool ...]`` directive, scanning on after each one (so JSON arguments are never re-read)."""
    tools: list[ToolDirective] = []
    position = 0
    while (match := _TOOL_RE.search(text, position)) is not None:
        tool, position = _parse_tool(text, match)
        tools.append(tool)
    return tuple(tools)


def _parse_tool(text: str, match: re.Match[str]) -> tuple[ToolDirective, int]:
    """The directive that ``match`` starts, and the position after its ``]``."""
    name, end = match.group(1), match.end()
    arguments: Any = {}
    if text[end : end + 1] == "{":
        try:
            arguments, end = json.JSONDecoder().raw_decode(text, end)
        except json.JSONDecodeError as exc:
            raise BadRequestError(f"[tool {name}]: arguments are not valid JSON: {exc}") from exc
    later: list[str] = []
    while (then := _THEN_RE.match(text, end)) is not None:
        try:
            more, end = json.JSONDecoder().raw_decode(text, then.end())
        except json.JSONDecodeError as exc:
            raise BadRequestError(f"[tool {name}]: 'then' arguments are not valid JSON: {exc}") from exc
        later.append(json.dumps(more))
    tail = _TOOL_END_RE.match(text, end)
    if later and tail is not None and tail.group(1) is not None:
        raise BadRequestError(f"[tool {name}]: 'then' and 'times' cannot be combined")
    if later and tail is not None:
        return ToolDirective(name, json.dumps(arguments), 1 + len(later), tuple(later)), tail.end()
    if tail is None:
        raise BadRequestError(f"[tool {name}]: expected ']' or 'times K]' after the arguments")
    times = tail.group(1)
    if times is not None and not (times.isascii() and times.isdigit() and int(times) >= 1):
        raise BadRequestError(f"[tool {name}]: 'times' needs a whole number K >= 1, got {times!r}")
    return ToolDirective(name, json.dumps(arguments), int(times or 1)), tail.end()


def _prompt_index(messages: list[Json]) -> int:
    """Index of the last user message that is not a continuation prompt (-1 if none)."""
    for i in range(len(messages) - 1, -1, -1):
        text = message_text(messages[i]).lstrip().lower()
        resumes = (
            i > 0 and messages[i - 1].get("role") == "assistant" and text.startswith(CONTINUE_PREFIX.lower())
        )
        if messages[i].get("role") == "user" and not resumes:
            return i
    return -1


def _call_of(messages: list[Json], tool_message: Json) -> Json | None:
    """The function (name, arguments) of the latest tool call answered by ``tool_message``, if found."""
    call_id = tool_message.get("tool_call_id")
    for message in reversed(messages) if call_id is not None else ():
        for call in message.get("tool_calls") or []:
            if isinstance(call, dict) and call.get("id") == call_id:
                function = call.get("function")
                return function if isinstance(function, dict) else {}
    return None


def _tool_name(messages: list[Json], tool_message: Json, default: str | None) -> str:
    function = _call_of(messages, tool_message)
    if function is not None:
        return str(function.get("name") or default or "tool")
    return default or str(tool_message.get("name") or "tool")


def _json_value(arguments: Any) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def _directive_of(tools: tuple[ToolDirective, ...], messages: list[Json], tool_message: Json) -> int | None:
    """Index of the tool directive a tool result counts for (see the module docstring)."""
    name = _tool_name(messages, tool_message, tools[0].name if tools else None)
    candidates = [i for i, tool in enumerate(tools) if tool.name == name]
    if len(candidates) > 1:
        arguments = _json_value((_call_of(messages, tool_message) or {}).get("arguments"))
        candidates = [i for i in candidates if arguments in tools[i].all_arguments()] or candidates
    return candidates[0] if candidates else None


def _pending_tools(directives: Directives, messages: list[Json], prompt: int) -> list[ToolDirective]:
    """The tool directives with fewer than ``times`` results after the prompt: the next parallel step."""
    results = [0] * len(directives.tools)
    for message in messages[prompt + 1 :]:
        index = _directive_of(directives.tools, messages, message) if message.get("role") == "tool" else None
        if index is not None:
            results[index] += 1
    return [tool.call(n) for tool, n in zip(directives.tools, results, strict=True) if n < tool.times]


def _latest_batch(messages: list[Json], prompt: int, last_tool: int) -> list[Json]:
    """The tool messages after the last assistant message with tool calls before ``last_tool``."""
    start = prompt
    for i in range(last_tool, prompt, -1):
        if messages[i].get("role") == "assistant" and messages[i].get("tool_calls"):
            start = i
            break
    return [m for m in messages[start + 1 : last_tool + 1] if m.get("role") == "tool"]


def _follow_up_text(messages: list[Json], batch: list[Json], directives: Directives) -> str:
    """``Tool NAME returned: CONTENT`` for each result of the batch, then `` 1 2 ... N`` if counting."""
    default = directives.default_tool_name
    results = (f"Tool {_tool_name(messages, m, default)} returned: {message_text(m)}" for m in batch)
    return "; ".join(results) + "".join(f" {i}" for i in range(1, (directives.count_to or 0) + 1))


def _resume_words(text: str, prior: str, habit: Directives | None = None) -> list[str]:
    sent = prior.split()
    skip = len(sent)
    if prior and habit is not None and habit.restart == "all":
        return [w.lstrip() if i == 0 else w for i, w in enumerate(_WORD_RE.findall(text))]
    if prior and habit is not None and habit.restart == "sentence":
        ends = [i + 1 for i, word in enumerate(sent) if word.endswith((".", "!", "?"))]
        skip = ends[-1] if ends else 0
    elif prior and habit is not None and habit.repeat:
        skip = max(0, skip - habit.repeat)
    words = _WORD_RE.findall(text)[skip:]
    if prior and words:
        words[0] = " " + words[0].lstrip()
    return words


def _count_pieces(n: int, prior: str, habit: Directives | None = None) -> list[str]:
    numbers = _INT_RE.findall(prior)
    start = int(numbers[-1]) + 1 if numbers else 1
    if numbers and habit is not None and habit.repeat:
        start = max(1, start - habit.repeat)
    return [str(i) if i == 1 and not prior.strip() else f" {i}" for i in range(start, n + 1)]


def _tool_call_deltas(index: int, call_id: str, tool: ToolDirective) -> list[Json]:
    """The deltas of one tool call: its id and name, then its arguments in up to three pieces."""
    name, arguments = tool.name, tool.arguments
    first = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    n = 3 if len(arguments) >= 6 else min(len(arguments), 2)
    bounds = [round(i * len(arguments) / n) for i in range(n + 1)] if n else [0]
    pieces = [arguments[a:b] for a, b in itertools.pairwise(bounds)]
    return [{"tool_calls": [first]}] + [
        {"tool_calls": [{"index": index, "function": {"arguments": piece}}]} for piece in pieces
    ]


def _tool_step_deltas(tools: list[ToolDirective], serial: int) -> list[Json]:
    """One step of parallel calls; ids ``call_<serial>_<index>`` are unique per response number."""
    return [d for i, tool in enumerate(tools) for d in _tool_call_deltas(i, f"call_{serial}_{i}", tool)]


def is_summary_request(messages: list[Json]) -> bool:
    """True if a ``system`` message contains :data:`SUMMARY_MARKER` (see the module docstring)."""
    return any(m.get("role") == "system" and SUMMARY_MARKER in message_text(m) for m in messages)


def _summary_plan(messages: list[Json], serial: int) -> Plan:
    """``Summary of K lines.``: K non-empty lines in the last user message; no directives are read."""
    users = [message_text(m) for m in messages if m.get("role") == "user"]
    lines = sum(1 for line in (users[-1] if users else "").splitlines() if line.strip())
    deltas = [{"content": w} for w in _WORD_RE.findall(f"Summary of {lines} lines.")]
    return Plan(deltas, "stop", Directives(), follow_up=False, serial=serial, summary=True)


def plan_reply(messages: list[Json], serial: int = 0) -> Plan:
    """Decide the reply to a request from its messages; ``serial`` numbers the response (tool call ids)."""
    if is_summary_request(messages):
        return _summary_plan(messages, serial)
    prompt = _prompt_index(messages)
    directives = parse_directives(message_text(messages[prompt]) if prompt >= 0 else "")
    tools = [i for i in range(prompt + 1, len(messages)) if messages[i].get("role") == "tool"]
    start = tools[-1] if tools else prompt
    prior = "".join(message_text(m) for m in messages[start + 1 :] if m.get("role") == "assistant")
    follow_up = prompt != len(messages) - 1
    pending = _pending_tools(directives, messages, prompt)
    if pending:
        return Plan(_tool_step_deltas(pending, serial), "tool_calls", directives, follow_up, serial=serial)
    if tools:
        text = _follow_up_text(messages, _latest_batch(messages, prompt, tools[-1]), directives)
        deltas = [{"content": w} for w in _resume_words(text, prior)]
    elif directives.files:
        deltas = [{"content": w} for w in _resume_words(describe_files(messages[prompt]), prior)]
    elif directives.count_to is not None:
        deltas = [{"content": p} for p in _count_pieces(directives.count_to, prior, directives)]
    else:
        reply = STORY if directives.story else FIXED_REPLY
        deltas = [{"content": w} for w in _resume_words(reply, prior, directives)]
    return Plan(deltas, "stop", directives, follow_up, serial=serial)


def count_prompt_tokens(messages: list[Json]) -> int:
    chars = 0
    for message in messages:
        chars += len(message_text(message))
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            chars += len(str(function.get("name", ""))) + len(str(function.get("arguments", "")))
    return math.ceil(chars / 4) + 4 * len(messages)


def error_body(message: str, error_type: str, code: str | int | None, param: str | None = None) -> Json:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _error_response(status: int, body: Json | None = None) -> web.Response:
    """An error response; without ``body``, a standard one for ``status``."""
    if body is None and status == 429:
        body = error_body("Rate limit reached for scripted model.", "rate_limit_error", "rate_limit_exceeded")
    elif body is None:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = error_body(f"The scripted model failed with HTTP {status}.", kind, status)
    headers = {"x-should-retry": "false"}
    if status == 429:
        headers["Retry-After"] = str(RATE_LIMIT_RETRY_AFTER_S)
    return web.json_response(body, status=status, headers=headers)


@dataclass
class _Reply:
    """Per-response constants for building chunks."""

    id: str
    model: str
    created: int
    prompt_tokens: int
    rate: float
    include_usage: bool
    cached_tokens: int = 0

    def chunk(self, delta: Json, finish_reason: str | None = None) -> Json:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return self.envelope("chat.completion.chunk", choices=[choice])

    def usage(self, completion_tokens: int) -> Json:
        p, n = self.prompt_tokens, completion_tokens
        usage: Json = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": min(self.cached_tokens, p)}
        return usage

    def envelope(self, kind: str, **fields: Any) -> Json:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, **fields}


async def _wait_for_disconnect(request: web.Request) -> None:
    """Keep the response open without sending until the client leaves or the server shuts down."""
    closing = request.app[STATE_KEY].closing
    while request.transport is not None and not request.transport.is_closing() and not closing.is_set():
        try:
            await asyncio.wait_for(closing.wait(), timeout=0.1)
        except TimeoutError:
            pass


def _reset(request: web.Request, sent: int) -> None:
    """Close the connection at once with a TCP reset (SO_LINGER 0): no end of the chunked body."""
    log.info("%s %s: resetting the connection after %d chunks", request.method, request.path, sent)
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class Encoder(Protocol):
    """How one provider dialect writes a streamed reply (the pacing and faults are shared)."""

    def opening(self) -> list[bytes]:
        """The events before the first content chunk."""

    def delta(self, index: int, delta: Json) -> list[bytes]:
        """The events of the plan's delta number ``index`` (none while a dialect holds a piece back)."""

    def closing(self, sent: int, finish: bool) -> list[bytes]:
        """The events after the last of ``sent`` chunks; without ``finish``, no finish reason is sent."""

    def failure(self, status: int, sent: int) -> list[bytes]:
        """The in-stream error event of a ``[fail after K with STATUS]`` fired after ``sent`` chunks."""

    def broken(self) -> Json:
        """The payload a ``[malformed after K]`` sends cut off mid-object."""

    def message(self, sent: int) -> Json:
        """The whole reply of ``sent`` chunks, for a request that does not stream."""


def sse(payload: Json, event: str | None = None) -> bytes:
    """One server-sent event holding ``payload`` (with an ``event:`` line when named)."""
    line = b"data: " + json.dumps(payload).encode() + b"\n\n"
    return f"event: {event}\n".encode() + line if event else line


def cut_off(payload: Json) -> bytes:
    """``payload`` as an SSE data line cut off in the middle of its JSON, as a broken proxy would leave it."""
    whole = json.dumps(payload)
    return b"data: " + whole[: len(whole) // 2].encode() + b"\n\n"


class _ChatEncoder:
    """OpenAI Chat Completions chunks."""

    def __init__(self, plan: Plan, reply: _Reply) -> None:
        self.plan, self.reply = plan, reply

    def opening(self) -> list[bytes]:
        first: Json = {"role": "assistant", "content": "" if self.plan.finish_reason == "stop" else None}
        return [sse(self.reply.chunk(first))]

    def delta(self, index: int, delta: Json) -> list[bytes]:
        return [sse(self.reply.chunk(delta))]

    def closing(self, sent: int, finish: bool) -> list[bytes]:
        events = [sse(self.reply.chunk({}, self.plan.finish_reason))] if finish else []
        if self.reply.include_usage:
            usage = self.reply.usage(sent)
            events.append(sse(self.reply.envelope("chat.completion.chunk", choices=[], usage=usage)))
        return [*events, b"data: [DONE]\n\n"]

    def failure(self, status: int, sent: int) -> list[bytes]:
        message = self.plan.directives.error_says or f"Scripted failure after {sent} chunks."
        return [sse(error_body(message, "server_error", status))]

    def broken(self) -> Json:
        return self.reply.chunk({"content": " broken"})

    def message(self, sent: int) -> Json:
        choice = {"index": 0, "message": _final_message(self.plan), "finish_reason": self.plan.finish_reason}
        return self.reply.envelope("chat.completion", choices=[choice], usage=self.reply.usage(sent))


async def _write(response: web.StreamResponse, events: list[bytes]) -> None:
    if events:
        await response.write(b"".join(events))


async def _fault(
    request: web.Request, response: web.StreamResponse, plan: Plan, encoder: Encoder, sent: int
) -> bool:
    """Stall, fail, break or reset the stream if a fault is due after ``sent`` chunks; True if it is over."""
    if plan.fires(plan.directives.stall, sent):
        log.info("%s %s: stalling after %d chunks", request.method, request.path, sent)
        await _wait_for_disconnect(request)
        log.info("%s %s: stalled response released", request.method, request.path)
        return True
    fail = plan.active(plan.directives.fail)
    if fail is not None and fail.after == sent:
        await _write(response, encoder.failure(fail.status, sent))
        await response.write_eof()
        return True
    if plan.fires(plan.directives.malformed, sent):
        log.info("%s %s: sending a malformed chunk after %d chunks", request.method, request.path, sent)
        await response.write(cut_off(encoder.broken()))
        await response.write_eof()
        return True
    if plan.fires(plan.directives.eof, sent):
        log.info("%s %s: ending the stream cleanly after %d chunks", request.method, request.path, sent)
        await response.write_eof()
        return True
    if plan.fires(plan.directives.reset, sent):
        _reset(request, sent)
        raise _ConnectionReset
    return False


class _ConnectionReset(Exception):
    """The handler reset its own connection: there is no response left to finish."""


async def pace(state: ServerState, rate: float) -> None:
    """The pause before a chunk at ``rate`` chunks per second (none at ``rate <= 0``), cut short when the
    server hurries."""
    if rate > 0 and not state.hurry.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1 / rate):
                await state.hurry.wait()


async def stream_plan(request: web.Request, plan: Plan, rate: float, encoder: Encoder) -> web.StreamResponse:
    """Stream ``plan`` in ``encoder``'s dialect at ``rate`` chunks/s, with the plan's faults."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:  # one small write per chunk: without this, Nagle + delayed ACKs cap the rate
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await _write(response, encoder.opening())
    for sent in range(len(plan.deltas) + 1):
        if await _fault(request, response, plan, encoder, sent):
            return response
        if sent == len(plan.deltas):
            break
        await pace(request.app[STATE_KEY], rate)
        delta = plan.deltas[sent]
        if plan.directives.stamp and delta.get("content"):
            delta = {**delta, "content": f"{delta['content']}@{time.time():.4f}"}
        await _write(response, encoder.delta(sent, delta))
    await _write(response, encoder.closing(sent, finish=plan.active(plan.directives.no_finish) is None))
    await response.write_eof()
    return response


def _final_message(plan: Plan) -> Json:
    """The non-streaming message equivalent to the plan's deltas."""
    if plan.finish_reason != "tool_calls":
        return {"role": "assistant", "content": "".join(d.get("content", "") for d in plan.deltas)}
    calls: dict[int, Json] = {}
    for piece in (p for delta in plan.deltas for p in delta["tool_calls"]):
        index, function = piece["index"], piece["function"]
        if index not in calls:  # the first piece of a call carries its id and name
            calls[index] = {"id": piece["id"], "type": "function", "function": dict(function)}
        else:
            calls[index]["function"]["arguments"] += function["arguments"]
    return {"role": "assistant", "content": None, "tool_calls": [calls[i] for i in sorted(calls)]}


async def complete_plan(request: web.Request, plan: Plan, encoder: Encoder) -> web.StreamResponse:
    """Answer ``plan`` in one response body in ``encoder``'s dialect, with the plan's faults."""
    total = len(plan.deltas)
    if any(plan.fires(plan.directives.stall, sent) for sent in range(total + 1)):
        await _wait_for_disconnect(request)
        return web.Response(status=499)
    if any(plan.fires(plan.directives.reset, sent) for sent in range(total + 1)):
        _reset(request, 0)
        raise _ConnectionReset
    cut = (plan.directives.malformed, plan.directives.eof)
    if any(plan.fires(fault, sent) for fault in cut for sent in range(total + 1)):
        broken = cut_off(encoder.broken()).removeprefix(b"data: ").strip()
        return web.Response(body=broken, content_type="application/json")
    return web.json_response(encoder.message(total))


async def _read_messages(request: web.Request) -> tuple[Json, list[Json]]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"Request body is not valid JSON: {exc}") from exc
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequestError("'messages' must be a non-empty list of message objects.")
    return body, messages


def _context_length_error(message: str) -> web.Response:
    body = error_body(message, "invalid_request_error", "context_length_exceeded", "messages")
    return _error_response(400, body)


@dataclass(frozen=True)
class EarlyFault:
    """An HTTP error due before any content: ``status``, and for a context overflow its window."""

    status: int
    window: int | None = None  # the context window a prompt of `tokens` exceeds
    tokens: int = 0
    message: str | None = None  # what the request got wrong (a 400 the directives did not ask for)


def fault_message(fault: EarlyFault, overflow: str, by_status: dict[int, str]) -> str:
    """The message of an error body: ``overflow`` (formatted with ``tokens`` and ``window``) for an
    overflow, else the one ``by_status`` has, else a generic one."""
    if fault.message is not None:
        return fault.message
    if fault.window is not None:
        return overflow.format(tokens=fault.tokens, window=fault.window)
    return by_status.get(fault.status, f"The scripted model failed with HTTP {fault.status}.")


def early_fault(plan: Plan, stream: bool, prompt_tokens: int) -> EarlyFault | None:
    """The HTTP error due before any content, if any, in any dialect."""
    window = plan.directives.window
    if window is not None and prompt_tokens > window:
        return EarlyFault(400, window, prompt_tokens)
    if plan.active(plan.directives.overflow):
        return EarlyFault(400, *OVERFLOW_WINDOW)
    fail = plan.active(plan.directives.fail)
    if fail is not None and (fail.after == 0 or not stream) and fail.after <= len(plan.deltas):
        return EarlyFault(fail.status)
    return None


def _early_error(plan: Plan, stream: bool, prompt_tokens: int) -> web.Response | None:
    """The HTTP error response due before any content, if any, with OpenAI's error bodies."""
    fault = early_fault(plan, stream, prompt_tokens)
    if fault is None:
        return None
    if fault.window is not None:
        return _context_length_error(context_length_message(fault.window, fault.tokens))
    says = plan.directives.error_says
    if says is not None:
        kind = "server_error" if fault.status >= 500 else "invalid_request_error"
        return _error_response(fault.status, error_body(says, kind, fault.status))
    return _error_response(fault.status)


def _new_reply(request: web.Request, body: Json, plan: Plan, prompt_tokens: int) -> _Reply:
    state = request.app[STATE_KEY]
    rate = plan.directives.rate if plan.directives.rate is not None else state.token_rate
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    model = str(body.get("model") or MODEL_NAME)
    cached = plan.directives.cached or 0
    return _Reply(
        f"chatcmpl-scripted-{plan.serial}", model, int(time.time()), prompt_tokens, rate, usage, cached
    )


def note_request(request: web.Request, body: Json, messages: list[Json]) -> None:
    """Record a chat request (in any dialect) for the tests: its body, its messages, its client."""
    state = request.app[STATE_KEY]
    state.requests.append(body)
    state.chats.append(messages)
    state.clients.append(request.headers.get("User-Agent", ""))


def log_plan(request: web.Request, plan: Plan, stream: bool, prompt_tokens: int) -> None:
    log.info(
        "%s %s stream=%s follow_up=%s prompt_tokens=%d directives: %s",
        request.method,
        request.path,
        stream,
        plan.follow_up,
        prompt_tokens,
        "summarisation request" if plan.summary else plan.directives.summary(),
    )


def _note_prompt(state: ServerState, plan: Plan, messages: list[Json]) -> Plan:
    """Remember a first request's prompt; the plan learns whether it was seen before (a retry), and the
    server's context window when its prompt names none."""
    if state.context_window and not plan.summary and plan.directives.window is None:
        directives = dataclasses.replace(plan.directives, window=state.context_window)
        plan = dataclasses.replace(plan, directives=directives)
    if plan.follow_up or plan.summary:
        return plan
    prompt = json.dumps(messages[_prompt_index(messages)], sort_keys=True)
    plan = dataclasses.replace(plan, repeat=prompt in state.prompts)
    state.prompts.add(prompt)
    return plan


async def chat_completions(request: web.Request) -> web.StreamResponse:
    try:
        body, messages = await _read_messages(request)
        plan = plan_reply(messages, next(request.app[STATE_KEY].ids))
    except BadRequestError as exc:
        log.info("%s %s rejected: %s", request.method, request.path, exc)
        return _error_response(400, error_body(str(exc), "invalid_request_error", None))
    note_request(request, body, messages)
    plan = _note_prompt(request.app[STATE_KEY], plan, messages)
    stream, prompt_tokens = bool(body.get("stream")), count_prompt_tokens(messages)
    log_plan(request, plan, stream, prompt_tokens)
    early = _early_error(plan, stream, prompt_tokens)
    if early is not None:
        return early
    reply = _new_reply(request, body, plan, prompt_tokens)
    request.app[STATE_KEY].in_flight += 1
    try:
        encoder = _ChatEncoder(plan, reply)
        if stream:
            return await stream_plan(request, plan, reply.rate, encoder)
        return await complete_plan(request, plan, encoder)
    except ConnectionResetError:
        log.info("%s %s: client went away", request.method, request.path)
        return web.Response(status=499)
    except _ConnectionReset:
        return web.Response(status=499)  # never sent: the transport is gone
    finally:
        request.app[STATE_KEY].in_flight -= 1


async def list_models(request: web.Request) -> web.Response:
    log.info("%s %s", request.method, request.path)
    model = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "thinkproject"}
    return web.json_response({"object": "list", "data": [model]})


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError:
        log.warning("Ignoring invalid %s=%r", name, raw)
        return default


def _env_token_rate() -> float:
    raw = os.environ.get("SCRIPTED_MODEL_TOKEN_RATE", "")
    try:
        return float(raw) if raw.strip() else DEFAULT_TOKEN_RATE
    except ValueError:
        log.warning("Ignoring invalid SCRIPTED_MODEL_TOKEN_RATE=%r", raw)
        return DEFAULT_TOKEN_RATE


async def _on_shutdown(app: web.Application) -> None:
    app[STATE_KEY].closing.set()


DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


def build_app(*, token_rate: float | None = None, context_window: int | None = None) -> web.Application:
    """The scripted model app; ``token_rate`` (chunks/s, ``<= 0`` = unpaced) overrides the environment;
    ``context_window`` (tokens) is the window it holds every request to (None: none)."""
    app = web.Application(client_max_size=_env_int("SCRIPTED_MODEL_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES))
    app[STATE_KEY] = ServerState(
        _env_token_rate() if token_rate is None else float(token_rate), context_window or None
    )
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    from think_scripted.responses import add_routes  # here: that module imports this one

    add_routes(app)  # the Responses API (POST/GET /v1/responses...)
    from think_scripted.dialects import add_routes as add_dialects

    add_dialects(app)  # Anthropic's Messages API and Gemini's generateContent
    return app


class ScriptedModelServer:
    """Runs the app on 127.0.0.1 on a free port, in a background thread with its own event loop."""

    def __init__(
        self, *, token_rate: float | None = None, host: str = "127.0.0.1", context_window: int | None = None
    ) -> None:
        self.app = build_app(token_rate=token_rate, context_window=context_window)
        self.host = host
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The OpenAI ``api_base``, e.g. ``http://127.0.0.1:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def requests(self) -> list[Json]:
        """Bodies of the chat completion requests received so far, oldest first."""
        return list(self.app[STATE_KEY].requests)

    @property
    def chats(self) -> list[list[Json]]:
        """The messages of every chat request in any dialect (Anthropic's and Gemini's turned into the
        chat API's form), oldest first."""
        return list(self.app[STATE_KEY].chats)

    @property
    def clients(self) -> list[str]:
        """The User-Agent of each chat completion request (which HTTP client sent it), oldest first."""
        return list(self.app[STATE_KEY].clients)

    @property
    def in_flight(self) -> int:
        """Number of chat completion requests being answered right now (stalled ones included)."""
        return self.app[STATE_KEY].in_flight

    @property
    def responses_created(self) -> int:
        """Number of Responses API generations started (see :mod:`think_scripted.responses`)."""
        from think_scripted.responses import RESPONSES_KEY

        return self.app[RESPONSES_KEY].created

    @property
    def response_output_tokens(self) -> dict[str, int]:
        """Output tokens (chunks) generated so far per Responses API response id, forgotten ones included."""
        from think_scripted.responses import RESPONSES_KEY

        return dict(self.app[RESPONSES_KEY].output_tokens)

    def hurry(self, on: bool = True) -> None:
        """From now on (until ``hurry(False)``), paced replies and Responses generations, those under
        way included, send what is left of them at once."""
        event = self.app[STATE_KEY].hurry
        assert self._loop is not None, "the server is not running"
        self._loop.call_soon_threadsafe(event.set if on else event.clear)

    def start(self) -> ScriptedModelServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="scripted-model", daemon=True)
        self._thread.start()
        self._runner = asyncio.run_coroutine_threadsafe(self._setup(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        loop, runner, thread = self._loop, self._runner, self._thread
        if loop is None or thread is None:
            return
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        self._loop, self._runner, self._thread = None, None, None

    async def _setup(self) -> web.AppRunner:
        runner = web.AppRunner(self.app, shutdown_timeout=1.0, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        self.port = int(runner.addresses[0][1])
        return runner

    def __enter__(self) -> ScriptedModelServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Deterministic scriptable OpenAI-compatible model server.")
    parser.add_argument("--host", default=os.environ.get("SCRIPTED_MODEL_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("SCRIPTED_MODEL_PORT", "8765")))
    parser.add_argument("--token-rate", type=float, default=None, help="chunks/s (default: env or 20)")
    parser.add_argument(
        "--context-window",
        type=int,
        default=_env_int("SCRIPTED_MODEL_CONTEXT_WINDOW", CONTEXT_WINDOW),
        help=f"tokens; a longer prompt is refused (default: env or {CONTEXT_WINDOW}; 0: none)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(token_rate=args.token_rate, context_window=args.context_window)
    state = app[STATE_KEY]
    log.info(
        "scripted model on http://%s:%s/v1 (token rate %s/s, context window %s tokens)",
        args.host,
        args.port,
        state.token_rate,
        state.context_window or "no",
    )
    web.run_app(app, host=args.host, port=args.port, print=None, shutdown_timeout=1.0, access_log=None)


if __name__ == "__main__":
    main()
