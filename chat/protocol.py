"""The `cf_agent_*` wire codec: parse client frames, build server frames. No database, no I/O."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recovery.stream.encoding import dumps

from .exceptions import AnswerRefused, LimitExceeded, ProtocolError
from .types import UIMessage

USE_CHAT_REQUEST = "cf_agent_use_chat_request"
USE_CHAT_RESPONSE = "cf_agent_use_chat_response"
CHAT_MESSAGES = "cf_agent_chat_messages"
CHAT_CLEAR = "cf_agent_chat_clear"
CHAT_REQUEST_CANCEL = "cf_agent_chat_request_cancel"
STREAM_RESUMING = "cf_agent_stream_resuming"
STREAM_RESUME_ACK = "cf_agent_stream_resume_ack"
STREAM_RESUME_REQUEST = "cf_agent_stream_resume_request"
STREAM_RESUME_NONE = "cf_agent_stream_resume_none"
STREAM_PENDING = "cf_agent_stream_pending"
TOOL_RESULT = "cf_agent_tool_result"
TOOL_APPROVAL = "cf_agent_tool_approval"
MESSAGE_UPDATED = "cf_agent_message_updated"
CHAT_RECOVERING = "cf_agent_chat_recovering"
# thinkproject's own: a turn accepted but waiting (docs/protocol.md); clients without it ignore it.
CHAT_QUEUED = "cf_agent_chat_queued"
QUEUED_BEHIND_TURNS = "conversation"  # behind `position` turns of its own conversation
QUEUED_FOR_WORKER = "workers"  # no worker has begun it (every slot busy, a long broker queue, a busy loop)
QUEUED_FOR_SERVER = "server"  # the web process has not finished accepting it (busy with other requests)
IDENTITY = "cf_agent_identity"
# thinkproject's own: stop everything of the conversation (docs/protocol.md "Stop everything"); the
# published client's cancel (CHAT_REQUEST_CANCEL) keeps its meaning, one request.
CHAT_STOP = "cf_agent_chat_stop"
CHAT_STOPPED = "cf_agent_chat_stopped"
# thinkproject's own: bring back another branch after a message (docs/protocol.md "Branches").
CHAT_BRANCH = "cf_agent_chat_branch"
# thinkproject's own: a tool result or approval the server refused, and why (docs/protocol.md "Refusals").
TOOL_REFUSED = "cf_agent_tool_refused"
CHAT_BRANCH_REFUSED = "cf_agent_chat_branch_refused"

ROLES = frozenset({"user", "assistant", "system"})
MAX_ID_LENGTH = 255
# Deeper JSON is refused: no client writes it, and every later reader (Postgres, json) recurses on it.
MAX_JSON_DEPTH = 100


@dataclass(frozen=True)
class Limits:
    """Size limits of client frames (the THINK settings of the same names; see chat.wire.limits)."""

    max_frame_bytes: int = 1_000_000
    max_message_bytes: int = 256_000  # the JSON of one UIMessage
    max_message_parts: int = 200
    max_tool_output_bytes: int = 256_000  # the JSON of one cf_agent_tool_result output
    max_client_tools_bytes: int = 100_000  # the JSON of a frame's `clientTools` (their schemas)


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class ChatRequest:
    id: str
    messages: list[UIMessage]
    trigger: str
    extra: dict[str, Any] = field(default_factory=dict)  # custom body fields, kept as request context
    client_tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Clear:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class SwitchBranch:
    anchor_id: str  # the message the alternatives follow ("" for the start)
    index: int


@dataclass(frozen=True)
class ResumeRequest:
    probe_id: str | None


@dataclass(frozen=True)
class ResumeAck:
    id: str


@dataclass(frozen=True)
class ToolResult:
    tool_call_id: str
    tool_name: str
    output: Any
    state: str
    error_text: str | None
    auto_continue: bool
    client_tools: list[dict[str, Any]] | None


@dataclass(frozen=True)
class ToolApproval:
    tool_call_id: str
    approved: bool
    auto_continue: bool


@dataclass(frozen=True)
class ClientMessages:
    messages: list[UIMessage]


Frame = (
    ChatRequest
    | Cancel
    | Clear
    | Stop
    | SwitchBranch
    | ResumeRequest
    | ResumeAck
    | ToolResult
    | ToolApproval
    | ClientMessages
)


def parse_frame(text: str | bytes, limits: Limits = DEFAULT_LIMITS) -> Frame | None:
    """Parse one client frame. Unknown types give None; malformed known frames raise ProtocolError.

    Known frames are also refused when they hold what Postgres cannot store (NUL characters, lone
    surrogates, NaN or Infinity) or JSON nested deeper than MAX_JSON_DEPTH.
    """
    size = utf8_length(text, limits.max_frame_bytes)
    if size > limits.max_frame_bytes:
        raise LimitExceeded(f"frame is larger than {limits.max_frame_bytes} bytes")
    data = _loads(text, "frame is not JSON")
    if not isinstance(data, dict):
        raise ProtocolError("frame is not a JSON object")
    frame_type = data.get("type")
    parser = _PARSERS.get(frame_type) if isinstance(frame_type, str) else None
    if parser is None:
        return None
    check_storable(data)
    return parser(data, limits)


_SNIFF_CHARS = 1024
_CHAT_REQUEST_TYPE = re.compile(r'"type"\s*:\s*"cf_agent_use_chat_request"')
_ID_FIELD = re.compile(r'"id"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.){1,1530}")')


def refused_request_id(text: str) -> str | None:
    """The id of a refused chat request, so that its client stream can end with the reason; else None.

    Best effort, and the same cost for any frame (one refused for its size, or one of a flood): only
    the first and last 1024 characters are read. Clients write `id` and `type` around the long `init`.
    """
    ends = (text[:_SNIFF_CHARS], text[-_SNIFF_CHARS:])
    if not any(_CHAT_REQUEST_TYPE.search(end) for end in ends):
        return None
    for end in ends:
        found = _ID_FIELD.search(end)
        if found is None:
            continue
        try:
            request_id = json.loads(found.group(1))
            _check_text(request_id)
        except (ValueError, RecursionError):
            continue
        if 0 < len(request_id) <= MAX_ID_LENGTH:
            return request_id
    return None


def _loads(text: str | bytes, error: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"{error}: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"{error}: nested too deeply") from None


def utf8_length(text: str | bytes, limit: int) -> int:
    """The UTF-8 size of `text`; past `limit` only a lower bound, so a huge frame is never encoded."""
    if isinstance(text, bytes) or len(text) > limit or text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def check_storable(value: Any) -> None:
    """Raise ProtocolError for JSON that Postgres cannot store or that is nested too deeply."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ProtocolError("numbers must be finite (no NaN or Infinity)")
        elif isinstance(item, dict | list) and depth >= MAX_JSON_DEPTH:
            raise ProtocolError(f"JSON is nested deeper than {MAX_JSON_DEPTH} levels")
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key)
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    if "\x00" in text:
        raise ProtocolError("text must not contain NUL characters")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError("text must not contain lone surrogates") from None


def _str_field(
    data: dict[str, Any], key: str, *, required: bool = True, max_length: int = MAX_ID_LENGTH
) -> str:
    value = data.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise ProtocolError(f"{key!r} must be a non-empty string")
    if len(value) > max_length:
        raise ProtocolError(f"{key!r} is longer than {max_length} characters")
    return value


def validate_ui_message(message: Any) -> UIMessage:
    if not isinstance(message, dict):
        raise ProtocolError("each message must be an object")
    if not isinstance(message.get("id"), str) or not message["id"] or len(message["id"]) > MAX_ID_LENGTH:
        raise ProtocolError("each message needs a string 'id' of at most 255 characters")
    if not isinstance(message.get("role"), str) or message["role"] not in ROLES:
        raise ProtocolError(f"message {message['id']!r}: 'role' must be one of user, assistant, system")
    parts = message.get("parts", [])
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and isinstance(p.get("type"), str) for p in parts
    ):
        raise ProtocolError(f"message {message['id']!r}: 'parts' must be a list of objects with a 'type'")
    if (
        "metadata" in message
        and message["metadata"] is not None
        and not isinstance(message["metadata"], dict)
    ):
        raise ProtocolError(f"message {message['id']!r}: 'metadata' must be an object")
    return {"id": message["id"], "role": message["role"], "parts": parts, "metadata": message.get("metadata")}


def check_message_limits(message: UIMessage, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a (validated) UIMessage with too many parts or too much JSON.

    The server applies this to the messages a request adds: clients echo the whole transcript, and the
    messages the server wrote itself (long answers, big tool outputs) must not block later requests.
    """
    if len(message["parts"]) > limits.max_message_parts:
        raise LimitExceeded(
            f"message {message['id']!r} has {len(message['parts'])} parts;"
            f" at most {limits.max_message_parts} are accepted"
        )
    if json_size(message) > limits.max_message_bytes:
        raise LimitExceeded(f"message {message['id']!r} is larger than {limits.max_message_bytes} bytes")


def json_size(value: Any) -> int:
    """Bytes of the compact UTF-8 JSON of `value`."""
    return len(dumps(value).encode("utf-8", "surrogatepass"))


def _parse_client_tools(value: Any, limits: Limits) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in value
    ):
        raise ProtocolError("'clientTools' must be a list of objects with a 'name'")
    if json_size(value) > limits.max_client_tools_bytes:
        raise LimitExceeded(f"'clientTools' is larger than {limits.max_client_tools_bytes} bytes")
    return value


def _parse_chat_request(data: dict[str, Any], limits: Limits) -> ChatRequest:
    request_id = _str_field(data, "id")
    init = data.get("init")
    if not isinstance(init, dict) or init.get("method", "POST") != "POST":
        raise ProtocolError("'init' must be an object with method POST")
    raw_body = init.get("body")
    if not isinstance(raw_body, str):
        raise ProtocolError("'init.body' must be a JSON string")
    body = _loads(raw_body, "'init.body' is not valid JSON")
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise ProtocolError("'init.body' must be an object with a 'messages' array")
    return chat_request(request_id, body, limits)


def parse_chat_body(text: str | bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The JSON body of an HTTP chat request (chat.wire.http): an object with a `messages` array, under
    the frame limits a WebSocket chat request meets. Its checks come with `chat_request`."""
    size = utf8_length(text, limits.max_frame_bytes)
    if size > limits.max_frame_bytes:
        raise LimitExceeded(f"request body is larger than {limits.max_frame_bytes} bytes")
    body = _loads(text, "request body is not JSON")
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise ProtocolError("request body must be a JSON object with a 'messages' array")
    return body


def chat_request(request_id: str, body: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> ChatRequest:
    """A chat request from its body, as the WebSocket's `init.body` or an HTTP POST carries it."""
    check_storable(body)
    messages = [validate_ui_message(m) for m in body["messages"]]
    trigger = body.get("trigger", "submit-message")
    if trigger not in ("submit-message", "regenerate-message"):
        raise ProtocolError("'trigger' must be submit-message or regenerate-message")
    client_tools = _parse_client_tools(body.get("clientTools"), limits)
    extra = {k: v for k, v in body.items() if k not in ("messages", "trigger", "clientTools")}
    return ChatRequest(request_id, messages, trigger, extra, client_tools)


def _parse_tool_result(data: dict[str, Any], limits: Limits) -> ToolResult:
    tool_call_id = _str_field(data, "toolCallId")
    try:
        if json_size(data.get("output")) > limits.max_tool_output_bytes:
            raise LimitExceeded(f"tool output is larger than {limits.max_tool_output_bytes} bytes")
        client_tools = _parse_client_tools(data.get("clientTools"), limits)
    except LimitExceeded as exc:  # the client hears of it for its call
        raise AnswerRefused(str(exc), tool_call_id=tool_call_id) from None
    state = data.get("state") or "output-available"
    if state not in ("output-available", "output-error"):
        raise ProtocolError("'state' must be output-available or output-error")
    error_text = data.get("errorText")
    if error_text is not None and not isinstance(error_text, str):
        raise ProtocolError("'errorText' must be a string")
    # The client hook sends autoContinue false with an error; an explicit value is honoured either way.
    auto_continue = bool(data.get("autoContinue", state != "output-error"))
    return ToolResult(
        tool_call_id=tool_call_id,
        tool_name=_str_field(data, "toolName", required=False),
        output=data.get("output"),
        state=state,
        error_text=error_text,
        auto_continue=auto_continue,
        client_tools=client_tools,
    )


def _parse_tool_approval(data: dict[str, Any], limits: Limits) -> ToolApproval:
    if not isinstance(data.get("approved"), bool):
        raise ProtocolError("'approved' must be a boolean")
    return ToolApproval(
        _str_field(data, "toolCallId"), data["approved"], bool(data.get("autoContinue", True))
    )


def _parse_resume_request(data: dict[str, Any], limits: Limits) -> ResumeRequest:
    probe = data.get("probeId")
    if probe is not None and (not isinstance(probe, str) or len(probe) > MAX_ID_LENGTH):
        raise ProtocolError("'probeId' must be a short string")
    return ResumeRequest(probe)


def _parse_client_messages(data: dict[str, Any], limits: Limits) -> ClientMessages:
    if not isinstance(data.get("messages"), list):
        raise ProtocolError("'messages' must be an array")
    return ClientMessages([validate_ui_message(m) for m in data["messages"]])


def _parse_branch(data: dict[str, Any]) -> SwitchBranch:
    anchor = data.get("anchorId", "")
    if not isinstance(anchor, str) or len(anchor) > MAX_ID_LENGTH:
        raise ProtocolError("'anchorId' must be a message id (or empty for the start)")
    index = data.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ProtocolError("'index' must be a whole number, 0 or more")
    return SwitchBranch(anchor, index)


_PARSERS: dict[str, Callable[[dict[str, Any], Limits], Frame]] = {
    USE_CHAT_REQUEST: _parse_chat_request,
    CHAT_REQUEST_CANCEL: lambda d, _: Cancel(_str_field(d, "id")),
    CHAT_CLEAR: lambda d, _: Clear(),
    CHAT_STOP: lambda d, _: Stop(),
    CHAT_BRANCH: lambda d, _: _parse_branch(d),
    STREAM_RESUME_REQUEST: _parse_resume_request,
    STREAM_RESUME_ACK: lambda d, _: ResumeAck(_str_field(d, "id")),
    TOOL_RESULT: _parse_tool_result,
    TOOL_APPROVAL: _parse_tool_approval,
    CHAT_MESSAGES: _parse_client_messages,
}


# -- server frames -----------------------------------------------------------------------------------
def chunk_frame(request_id_json: str, body: str, seq: int, *, continuation: bool = False) -> str:
    """The live frame of one chunk; request_id_json is the request id already JSON-encoded."""
    cont = ',"continuation":true' if continuation else ""
    body_json = dumps(body)
    return (
        f'{{"type":"{USE_CHAT_RESPONSE}","id":{request_id_json},"body":{body_json},'
        f'"done":false,"seq":{seq}{cont}}}'
    )


def chunk_framer(request_id: str, *, continuation: bool = False) -> Callable[[str, int], str]:
    """The live frame of each chunk of one stream, from its body and seq (what a StreamWriter sends)."""
    request_id_json = dumps(request_id)

    def frame(body: str, seq: int) -> str:
        return chunk_frame(request_id_json, body, seq, continuation=continuation)

    return frame


def response_frame(
    request_id: str,
    body: str = "",
    *,
    done: bool = False,
    error: bool = False,
    continuation: bool = False,
    replay: bool = False,
    replay_complete: bool = False,
    seq: int | None = None,
    outcome: str | None = None,
) -> str:
    frame: dict[str, Any] = {"type": USE_CHAT_RESPONSE, "id": request_id, "body": body, "done": done}
    flags = {
        "error": error,
        "continuation": continuation,
        "replay": replay,
        "replayComplete": replay_complete,
    }
    frame.update({k: True for k, on in flags.items() if on})
    if seq is not None:
        frame["seq"] = seq
    if outcome is not None:
        frame["outcome"] = outcome
    return dumps(frame)


def identity_frame(name: str, agent: str) -> str:
    return dumps({"type": IDENTITY, "name": name, "agent": agent})


def chat_messages_frame(messages: list[UIMessage], *, earlier: bool = False) -> str:
    """The transcript; `earlier` (sent only when true) says older messages exist than the first
    (chat.transcript.window; clients that do not know the field ignore it)."""
    frame: dict[str, Any] = {"type": CHAT_MESSAGES, "messages": messages}
    if earlier:
        frame["earlier"] = True
    return dumps(frame)


def stream_resuming_frame(request_id: str, probe_id: str | None = None) -> str:
    frame = {"type": STREAM_RESUMING, "id": request_id}
    if probe_id is not None:
        frame["probeId"] = probe_id
    return dumps(frame)


def stream_resume_none_frame(reason: str | None = None, probe_id: str | None = None) -> str:
    frame = {"type": STREAM_RESUME_NONE}
    if reason is not None:
        frame["reason"] = reason
    if probe_id is not None:
        frame["probeId"] = probe_id
    return dumps(frame)


def stream_pending_frame(request_id: str | None = None, probe_id: str | None = None) -> str:
    frame = {"type": STREAM_PENDING}
    if request_id is not None:
        frame["id"] = request_id
    if probe_id is not None:
        frame["probeId"] = probe_id
    return dumps(frame)


def chat_queued_frame(request_id: str, reason: str, position: int | None = None) -> str:
    """Turn `request_id` cannot start yet (`reason`: QUEUED_BEHIND_TURNS, with the `position` of turns
    ahead of it; QUEUED_FOR_WORKER; QUEUED_FOR_SERVER, still being accepted); its stream's first chunk,
    or its end, ends the wait."""
    frame: dict[str, Any] = {"type": CHAT_QUEUED, "id": request_id, "reason": reason}
    if position is not None:
        frame["position"] = position
    return dumps(frame)


def chat_stopped_frame(stopped: dict[str, Any]) -> str:
    """Everything of the conversation was stopped: `stopped` says what (request ids whose streams or
    queue places ended, submissions, tool calls settled as cancelled, recovery incidents closed)."""
    return dumps({"type": CHAT_STOPPED, **stopped})


def branch_refused_frame(anchor_id: str, index: int, reason: str) -> str:
    """A branch switch the server refused (the sender only): why, for the page to show."""
    return dumps({"type": CHAT_BRANCH_REFUSED, "anchorId": anchor_id, "index": index, "reason": reason})


def tool_refused_frame(tool_call_id: str, reason: str) -> str:
    """A tool result or approval the server refused and did not store (the sender only): why."""
    return dumps({"type": TOOL_REFUSED, "toolCallId": tool_call_id, "reason": reason})


def chat_clear_frame() -> str:
    return dumps({"type": CHAT_CLEAR})


def recovering_frame(recovering: bool, request_id: str | None = None) -> str:
    frame: dict[str, Any] = {"type": CHAT_RECOVERING, "recovering": recovering}
    if request_id is not None:
        frame["id"] = request_id
    return dumps(frame)


def message_updated_frame(message: UIMessage) -> str:
    return dumps({"type": MESSAGE_UPDATED, "message": message})
