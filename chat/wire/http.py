"""The AI SDK's HTTP chat wire (`useChat` with `DefaultChatTransport`), on the same durable turns.

- `POST <mount>/ai/<agent>`: the body `{id, messages, trigger, messageId?, ...}` (the chat id is the
  conversation's name) is accepted as a WebSocket chat request is (chat.transcript.turns.turn_accept:
  the same limits, queue policy and fencing); the answer is a server-sent-events stream of UI message
  chunks that follows the turn until it has really ended, across the recoveries that continue it.
- `GET <mount>/ai/<agent>/<chatId>/stream`: 204 when no turn is active; otherwise the active turn's
  answer from its `start`, then live.
- `POST <mount>/ai/<agent>/<chatId>/stop`: stops the conversation's turns (chat.turn.actions); aborting
  the fetch alone is a disconnect, which never stops a durable turn.

The web process holds the response and tails the turn (chat.wire.chain): the chunks are read from
Postgres and followed live through the conversation's group, so a worker that dies mid-answer does not
end the response, and a web process that dies is rejoined by the GET. `data: [DONE]` is sent only
when the turn has ended (finished, stopped, or failed); a response cut by a failure never says it.

Access is the WebSocket's (chat.access): `Authorization: Bearer <token>`, or the session cookie, and
then Django's CSRF check for the POSTs. A response holds one of the principal's socket slots while it
is open, a GET counts as a replay (PRINCIPAL_REPLAYS_PER_MINUTE).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse, StreamingHttpResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from .. import protocol as p
from ..access import Credentials, access_policy, conversation_open_as, conversation_read
from ..broadcast import FRAMES, STREAM_END, STREAM_STARTED, accept_announcer, announcer, group_name
from ..conf import frame_limits, think_setting
from ..exceptions import AccessDenied, ConversationLimit, UnknownAgent
from ..models import Conversation, Message
from ..transcript.interactions import tool_approval_apply, tool_part_name, tool_result_apply
from ..transcript.turns import turn_accept
from ..turn.actions import astop_conversation
from ..turn.registry import agent_class, conversation_name_problem, server_tool_names
from ..types import UIMessage
from . import silence
from .chain import ChainRead, Cursor, chain_read, rejoin_root
from .limits import SOCKET_RENEW_S, replay_refusal, socket_slot_release, socket_slot_renew, socket_slot_take
from .pool import web_db
from .resume import is_start

logger = logging.getLogger(__name__)

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "x-vercel-ai-ui-message-stream": "v1",
    "X-Accel-Buffering": "no",
}
# Group events a response holds while it sends; past this many it drops them and reads the store.
EVENT_BACKLOG = 256
DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def _refused(status: int, text: str) -> HttpResponse:
    """An error the AI SDK shows as it is: `createUIApiCallError` takes the body's text."""
    return HttpResponse(text, status=status, content_type="text/plain; charset=utf-8")


class _Door:
    """Who asks, checked as the WebSocket's connect checks it."""

    def __init__(self, request: HttpRequest, agent: str) -> None:
        self.request, self.agent = request, agent
        self.credentials = Credentials.from_request(request)
        client = request.META.get("REMOTE_ADDR")
        self.address: str | None = str(client) if client else None
        self.principal = ""

    def check(self, name: str, *, write: bool) -> HttpResponse | None:
        """None when `name` may be used; otherwise the refusal to answer. Runs in a thread (the ORM)."""
        try:
            agent_class(self.agent)
        except UnknownAgent:
            return _refused(404, f"unknown agent {self.agent!r}")
        problem = conversation_name_problem(name)
        if problem is not None:
            return _refused(400, problem)
        if write and self.credentials.token is None:  # a cookie's request: Django's CSRF check
            refusal = CsrfViewMiddleware(_unused).process_view(self.request, _unused, (), {})
            if refusal is not None:
                return _refused(403, "CSRF check failed: send the csrftoken cookie's value as X-CSRFToken")
        try:
            self.principal = access_policy().principal(self.credentials)
        except AccessDenied as exc:
            return _refused(403, str(exc))
        return None


def _unused(request: HttpRequest) -> HttpResponse:  # the CSRF check's callback: never called
    raise AssertionError("not a view")


def request_id_for(body: dict[str, Any]) -> str:
    """The request id of a POST. A new user message names its turn: the same message sent again (a
    retry after a network blip, a double click) is the same request, which turn_accept answers with
    the turn it started. An edit (same id, other parts) is another request; so is a regenerate."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else None
    if body.get("trigger", "submit-message") == "submit-message" and isinstance(last, dict):
        if last.get("role") == "user" and isinstance(last.get("id"), str):
            digest = hashlib.sha256(
                json.dumps([last["id"], last.get("parts")], sort_keys=True).encode()
            ).hexdigest()
            return f"http-{digest[:40]}"
    return f"http-{uuid.uuid4()}"


@csrf_exempt
@require_POST
async def send(request: HttpRequest, agent: str) -> HttpResponseBase:
    limits = frame_limits()
    length = request.META.get("CONTENT_LENGTH") or ""
    if length.isdigit() and int(length) > limits.max_frame_bytes:
        return _refused(413, f"request body is larger than {limits.max_frame_bytes} bytes")
    try:
        body = p.parse_chat_body(request.body, limits)
    except p.LimitExceeded as exc:
        return _refused(413, str(exc))
    except p.ProtocolError as exc:
        return _refused(400, f"Invalid chat request: {exc}")
    name = body.get("id")
    if not isinstance(name, str):
        return _refused(400, "Invalid chat request: 'id' (the chat id) must be a string")
    door = _Door(request, agent)
    refusal = await web_db(door.check)(name, write=True)
    if refusal is not None:
        return refusal
    try:
        chat = p.chat_request(request_id_for(body), body, limits)
        conversation = await web_db(conversation_open_as)(
            agent=agent, name=name, principal=door.principal, policy=access_policy(), address=door.address
        )
    except p.ProtocolError as exc:
        return _refused(400, f"Invalid chat request: {exc}")
    except ConversationLimit as exc:
        return _refused(429, str(exc))
    except AccessDenied as exc:
        return _refused(403, str(exc))
    slot = await _take_slot(door)
    if isinstance(slot, HttpResponse):
        return slot
    try:
        if chat.messages and chat.messages[-1]["role"] == "assistant":  # answers to its tool calls
            root = await _answer(door, conversation.pk, name, chat, limits)
        else:
            root = await _accept(door, conversation.pk, chat)
    except BaseException:
        await _release_slot(slot)
        raise
    if isinstance(root, HttpResponse):
        await _release_slot(slot)
        return root
    return _sse(ChainTail(conversation.pk, root, slot).events())


async def _accept(door: _Door, conversation_id: int, chat: p.ChatRequest) -> str | HttpResponse:
    """A new turn (or the one this request already started): its request id, the root of its chain."""
    policy = agent_class(door.agent)
    accepted = await web_db(turn_accept)(
        conversation_id=conversation_id,
        request=chat,
        policy=policy.message_concurrency,
        client_history=policy.accept_client_history,
        address=door.address,
        announce=accept_announcer(conversation_id),
    )
    if accepted.refused:
        extra = {"conversation_id": conversation_id}
        logger.warning("chat request refused: %s", accepted.refused, extra=extra)
        return _refused(429, f"Chat request refused: {accepted.refused}")
    if accepted.dropped:
        return _refused(409, "Chat request refused: the conversation is busy with another turn")
    return chat.id


async def _answer(
    door: _Door, conversation_id: int, name: str, chat: p.ChatRequest, limits: p.Limits
) -> str | None | HttpResponse:
    """The client's answers to its assistant message's tool calls (outputs of client tools, approval
    answers), applied as the WebSocket's tool frames are; the root of the continuation they start, or
    of the turn already running (this POST sent again), or None when nothing runs (more answers due)."""
    try:
        answers = await web_db(tool_answers)(
            conversation_id=conversation_id,
            message=chat.messages[-1],
            client_tools=chat.client_tools,
            limits=limits,
        )
    except p.LimitExceeded as exc:  # an output over MAX_TOOL_OUTPUT_BYTES, say
        return _refused(413, f"Tool answer refused: {exc}")
    except p.ProtocolError as exc:
        return _refused(422, f"Tool answer refused: {exc}")
    announce, server_tools, continuation = announcer(conversation_id), None, None
    for answer in answers:
        if isinstance(answer, p.ToolResult):
            if server_tools is None:
                server_tools = await web_db(server_tool_names)(door.agent, name, conversation_id)
            result = await web_db(tool_result_apply)(
                conversation_id=conversation_id,
                result=answer,
                server_tools=server_tools,
                announce=announce,
                address=door.address,
            )
        else:
            result = await web_db(tool_approval_apply)(
                conversation_id=conversation_id, approval=answer, announce=announce, address=door.address
            )
        if result.status == "refused":
            return _refused(422, f"Tool answer refused: {result.problem}")
        if result.refused:
            return _refused(429, f"Continuation refused: {result.refused}")
        continuation = result.continuation_request_id or continuation
    if continuation is not None:
        return continuation
    return await web_db(rejoin_root)(conversation_id=conversation_id)


_SETTLED = ("output-available", "output-error", "output-denied")


def tool_answers(
    *, conversation_id: int, message: UIMessage, client_tools: Any, limits: p.Limits
) -> list[p.ToolResult | p.ToolApproval]:
    """What an assistant message sent back by the AI SDK answers: each tool part the client settled
    (`addToolOutput`) or decided (`addToolApprovalResponse`) that the stored message still waits for.
    Parts it only echoes are not answers. An output for a call that waits for approval is refused:
    that call is a server tool's, whose output only the server writes."""
    stored = (
        Message.objects.filter(conversation_id=conversation_id, message_id=message["id"])
        .values_list("parts", flat=True)
        .first()
    ) or []
    was = {part.get("toolCallId"): part.get("state") for part in stored if "toolCallId" in part}
    answers: list[p.ToolResult | p.ToolApproval] = []
    for part in message["parts"]:
        call, state = part.get("toolCallId"), part.get("state")
        if not isinstance(call, str) or was.get(call) in _SETTLED:
            continue
        if state in ("output-available", "output-error"):
            if was.get(call) == "approval-requested":
                raise p.ProtocolError(
                    f"tool call {call} waits for approval: only the server writes its output"
                )
            frame = {
                "type": p.TOOL_RESULT,
                "toolCallId": call,
                "toolName": tool_part_name(part),
                "output": part.get("output"),
                "state": state,
                "errorText": part.get("errorText"),
                "clientTools": client_tools,
            }
        elif state == "approval-responded" and was.get(call) in (None, "approval-requested"):
            approval: Any = part.get("approval") if isinstance(part.get("approval"), dict) else {}
            frame = {"type": p.TOOL_APPROVAL, "toolCallId": call, "approved": approval.get("approved")}
        else:
            continue
        parsed = p.parse_frame(p.dumps(frame), limits)
        assert isinstance(parsed, p.ToolResult | p.ToolApproval)
        answers.append(parsed)
    return answers


@require_GET
async def rejoin(request: HttpRequest, agent: str, name: str) -> HttpResponseBase:
    found = await _existing(request, agent, name, write=False)
    if isinstance(found, HttpResponse):
        return found
    door, conversation = found
    if conversation is None:
        return HttpResponse(status=204)
    root = await web_db(rejoin_root)(conversation_id=conversation.pk)
    if root is None:
        return HttpResponse(status=204)
    refused = await sync_to_async(replay_refusal, thread_sensitive=False)(door.principal)
    if refused:
        return _refused(429, f"Resume refused: {refused}")
    slot = await _take_slot(door)
    if isinstance(slot, HttpResponse):
        return slot
    return _sse(ChainTail(conversation.pk, root, slot).events())


@csrf_exempt
@require_POST
async def stop(request: HttpRequest, agent: str, name: str) -> HttpResponse:
    found = await _existing(request, agent, name, write=True)
    if isinstance(found, HttpResponse):
        return found
    _, conversation = found
    if conversation is None:
        return JsonResponse({"stopped": False})
    report = await astop_conversation(conversation.pk)
    return JsonResponse({"stopped": report.stopped_anything, **report.as_dict()})


async def _existing(
    request: HttpRequest, agent: str, name: str, *, write: bool
) -> tuple[_Door, Conversation | None] | HttpResponse:
    """The asker and the conversation, if it exists and the asker may use it; else the refusal."""
    door = _Door(request, agent)
    refusal = await web_db(door.check)(name, write=write)
    if refusal is not None:
        return refusal
    try:
        conversation = await web_db(conversation_read)(agent=agent, name=name, credentials=door.credentials)
    except AccessDenied as exc:
        return _refused(403, str(exc))
    return door, conversation


def turn_response(conversation_id: int, request_id: str) -> StreamingHttpResponse:
    """A site's own view answers with a turn as the AI SDK reads it: the turn `request_id` started
    (`open_agent(...).save_messages(..., wait=False)`, say), from its `start` to its end, across
    recoveries; who may see it is the view's to check."""
    return _sse(ChainTail(conversation_id, request_id, None).events())


def _sse(events: AsyncIterator[bytes]) -> StreamingHttpResponse:
    return StreamingHttpResponse(events, content_type="text/event-stream", headers=SSE_HEADERS)


async def _take_slot(door: _Door) -> dict[str, Any] | HttpResponse:
    """A place among the principal's open sockets, as a WebSocket takes one; 429 when there is none."""
    slot: dict[str, Any] = {
        "principal": door.principal,
        "address": door.address,
        "socket": f"http.{uuid.uuid4()}",
    }
    refused = await sync_to_async(socket_slot_take, thread_sensitive=False)(**slot)
    if refused:
        logger.warning("HTTP chat response refused: %s", refused)
        return _refused(429, refused)
    return slot


async def _release_slot(slot: dict[str, Any]) -> None:
    await sync_to_async(socket_slot_release, thread_sensitive=False)(**slot)


_PART_STARTS = ('{"type":"text-start"', '{"type":"reasoning-start"')
_PART_ENDS = ('{"type":"text-end"', '{"type":"reasoning-end"')


def _event(body: str) -> bytes:
    return b"data: " + body.encode() + b"\n\n"


class ChainTail:
    """One response's view of a turn: the chunks of its chain from the store, then live from the
    conversation's group, each sent once and in order; a gap, a new stream of the chain, an end, or a
    silence is read from the store (chat.wire.chain)."""

    def __init__(
        self, conversation_id: int, root_request_id: str | None, slot: dict[str, Any] | None
    ) -> None:
        """`root_request_id` None: no turn to follow (tool answers that start none yet): just the end.
        `slot`: the principal's socket slot the response holds (renewed, then released), if any."""
        self.conversation_id = conversation_id
        self.root = root_request_id
        self.slot = slot
        self.cursor = Cursor()
        self.streams: dict[str, Any] = {}  # the chain's request ids -> stream ids, as last read
        self.foreign: set[str] = set()  # request ids of other turns' streams
        self.sent_any = False
        self.finished = False  # a finish chunk went out
        self.open_parts: dict[Any, str] = {}  # text and reasoning parts started and not ended: id -> end type
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(EVENT_BACKLOG)
        self.dropped = False

    async def events(self) -> AsyncIterator[bytes]:
        layer = get_channel_layer()
        assert layer is not None, "CHANNEL_LAYERS is not configured"
        channel = await layer.new_channel()
        group = group_name(self.conversation_id)
        # Joined before the first read of the store: nothing published after that read is missed.
        await layer.group_add(group, channel)
        tasks = [asyncio.create_task(self._pump(layer, channel))]
        if self.slot is not None:
            tasks.append(asyncio.create_task(self._renew(self.slot)))
        try:
            async for piece in self._follow():
                yield piece
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await layer.group_discard(group, channel)
            if self.slot is not None:
                with contextlib.suppress(Exception):
                    await _release_slot(self.slot)

    async def _pump(self, layer: Any, channel: str) -> None:
        """The group's events into the response's queue; never cancelled mid-receive but at the end
        (the pub/sub layer unsubscribes a channel whose receive is cancelled)."""
        while True:
            event = await layer.receive(channel)
            try:
                self.queue.put_nowait(event)
            except asyncio.QueueFull:
                self.dropped = True  # the store has it: the next read fills it

    async def _renew(self, slot: dict[str, Any]) -> None:
        while True:
            await asyncio.sleep(SOCKET_RENEW_S)
            await sync_to_async(socket_slot_renew, thread_sensitive=False)(**slot)

    async def _follow(self) -> AsyncIterator[bytes]:
        if self.root is None:
            yield DONE
            return
        read: ChainRead | None = await self._read()
        wait = silence.silence_wait()
        # When to read the store anyway (a silence: a lost frame, a lost start of a continuation), and
        # when to send a ping; both keep their time while other turns' events come and go.
        every = float(think_setting("HTTP_PING_S"))
        look_at, ping_at = time.monotonic() + wait, time.monotonic() + every
        while True:
            if read is not None:
                out = self._take(read)
                if read.outcome is not None:
                    yield out + self._ending(read)
                    return
                if read.bodies:
                    wait = silence.silence_wait()
                else:  # quiet in the store too (a stalled model, a continuation not started yet)
                    wait = min(wait * 2, silence.silence_wait() * 4)
                look_at = time.monotonic() + wait
                if out:
                    yield out
                    ping_at = time.monotonic() + every
                read = await self._read() if read.more else None
                continue
            now = time.monotonic()
            if now >= ping_at:
                yield b": ping\n\n"
                ping_at = now + every
            if now >= look_at:
                read = await self._read()
                continue
            try:
                async with asyncio.timeout(min(look_at, ping_at) - now):
                    event = await self.queue.get()
            except TimeoutError:
                continue
            live = self._live(event)
            if live is None or self.dropped:
                self.dropped = False
                read = await self._read()
            elif live:
                yield live
                look_at = time.monotonic() + silence.silence_wait()
                ping_at = time.monotonic() + every

    async def _read(self) -> ChainRead:
        assert self.root is not None
        return await web_db(chain_read)(
            conversation_id=self.conversation_id, root_request_id=self.root, cursor=self.cursor
        )

    def _take(self, read: ChainRead) -> bytes:
        self.cursor, self.streams = read.cursor, read.streams
        self.foreign -= set(read.streams)
        return self._out(read.bodies)

    def _out(self, bodies: list[str]) -> bytes:
        if bodies:
            self.sent_any = True
            self.finished = self.finished or any(b.startswith('{"type":"finish"') for b in bodies[-2:])
            for body in bodies:  # only a part's start and end are decoded, never its deltas
                if body.startswith(_PART_STARTS):
                    chunk = json.loads(body)
                    self.open_parts[chunk.get("id")] = chunk["type"].replace("-start", "-end")
                elif body.startswith(_PART_ENDS):
                    self.open_parts.pop(json.loads(body).get("id"), None)
        return b"".join(_event(body) for body in bodies)

    def _live(self, event: dict[str, Any]) -> bytes | None:
        """The bytes a group event adds (b"" for none); None when the store must be read instead."""
        kind, request_id = event.get("type"), str(event.get("request_id"))
        if kind not in (FRAMES, STREAM_STARTED, STREAM_END) or request_id in self.foreign:
            return b""
        stream_id = self.streams.get(request_id)
        if kind != FRAMES or stream_id is None or stream_id != self.cursor.stream_id:
            if request_id not in self.streams and kind == FRAMES:
                self.foreign.add(request_id)  # until a read finds it is the chain's
            return None
        frames = [(seq, text) for seq, text in event["frames"] if seq > self.cursor.seq]
        if not frames:
            return b""
        if frames[0][0] != self.cursor.seq + 1:
            return None  # a gap: the layer dropped frames
        first_stream = next(iter(self.streams.values()), None) == stream_id
        bodies = []
        for seq, text in frames:
            body = json.loads(text)["body"]
            if first_stream or not is_start(seq, body):
                bodies.append(body)
        self.cursor = Cursor(stream_id, frames[-1][0])
        return self._out(bodies)

    def _ending(self, read: ChainRead) -> bytes:
        """The close of the answer once its chain has ended, then [DONE]."""
        outcome = read.outcome
        if outcome == "error":
            end = [p.dumps({"type": "error", "errorText": read.error})]
        elif self.finished:
            end = []
        elif outcome == "completed":
            end = [p.dumps({"type": "finish"})]
        elif self.sent_any:  # stopped ("aborted"), or replaced before it could answer ("skipped")
            # The store closes what the stopped turn left open: so does the client, then it aborts.
            closes = [p.dumps({"type": kind, "id": part}) for part, kind in self.open_parts.items()]
            end = [*closes, p.dumps({"type": "abort", "reason": outcome})]
        else:
            end = []
        return self._out(end) + DONE
