"""The chat WebSocket consumer: thin glue between frames, services and the conversation's group.

Per connection it keeps four things: the request it owes a resume ACK for (no live frames until
then), whether it is parked in the pre-stream window, the highest seq sent per stream, which makes
replay-then-live gap-free and duplicate-free across processes, and when it last heard of each stream
it follows live, so that a lost tail is filled from Postgres too (chat.wire.silence).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from channels.consumer import get_handler_name
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer

from recovery.lease.fibers import conversation_busy
from recovery.observe.metrics import STREAM_FILLS
from recovery.stream.buffer import stream_chunks

from .. import protocol as p
from ..access import Credentials, access_policy, conversation_open_as
from ..broadcast import accept_announcer, announcer, group_name, release_parked
from ..conf import frame_limits, think_setting
from ..exceptions import (
    AccessDenied,
    AnswerRefused,
    BranchNotFound,
    ConversationBusy,
    ConversationLimit,
    UnknownAgent,
)
from ..transcript.interactions import InteractionResult, tool_approval_apply, tool_result_apply
from ..transcript.selectors import stream_for_request
from ..transcript.services import conversation_clear
from ..transcript.turns import turn_accept, turn_cancel
from ..transcript.window import Window, transcript_frame
from ..turn.actions import astop_conversation, aswitch_branch
from ..turn.registry import agent_class, conversation_name_problem, server_tool_names
from . import silence
from .limits import (
    SOCKET_RENEW_S,
    frame_bucket,
    replay_refusal,
    socket_slot_release,
    socket_slot_renew,
    socket_slot_take,
    socket_slots_counted,
)
from .oversize import SEND_LIMIT_BYTES, fit_frame, fits
from .pool import web_db
from .resume import ack_replay, connect_state, probe_answer, replay_page, stream_tail

if TYPE_CHECKING:
    from asgiref.typing import WebSocketDisconnectEvent

logger = logging.getLogger(__name__)

CLOSE_UNKNOWN_AGENT = 4404
CLOSE_BAD_NAME = 4400
CLOSE_FORBIDDEN = 4403
CLOSE_TOO_MANY_CONVERSATIONS = 4409  # the principal owns PRINCIPAL_MAX_CONVERSATIONS already
CLOSE_TOO_MANY_SOCKETS = 4429  # the principal (or anonymous address) has its sockets open already
SENT_SEQ_MEMORY = 32


class ChatConsumer(AsyncWebsocketConsumer):
    conversation_id: int
    group: str
    send_limit: int = SEND_LIMIT_BYTES

    async def send(  # type: ignore[override]
        self, text_data: str | None = None, bytes_data: bytes | None = None, close: bool = False
    ) -> None:
        """Every frame leaves here: one over the server's message limit is sent smaller (chat.wire.oversize)
        instead of making daphne close the socket with 1011."""
        if text_data is not None and not fits(text_data, self.send_limit):
            text_data = fit_frame(text_data, self.send_limit)
        await super().send(text_data, bytes_data, close)

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch without its `aclose_old_connections` before every message: that is a hop to
        the process's one sync thread for each client frame and each group event, most of them a batch
        of streamed chunks (11% of the web process's Python time at 200 turns, issue 37). Every database
        call here runs on chat.wire.pool, which checks its thread's connection around the call."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def websocket_disconnect(self, message: WebSocketDisconnectEvent) -> None:
        """Channels' without its `aclose_old_connections` after `disconnect`: a hop to the process's one
        sync thread per closed socket, to check connections that thread does not hold here (every
        database call of this consumer runs on chat.wire.pool, which checks its own)."""
        for group in self.groups:
            await self.channel_layer.group_discard(group, self.channel_name)
        await self.disconnect(message["code"])
        raise StopConsumer()

    async def connect(self) -> None:
        kwargs = self.scope["url_route"]["kwargs"]
        self.agent_name, self.instance_name = kwargs["agent"], kwargs["name"]
        self.pending_resume: str | None = None
        self.parked = False
        self.sent_seq: OrderedDict[str, int] = OrderedDict()
        # Streams followed live: request id -> [when to look them up if nothing comes, the wait].
        self.following: dict[str, list[float]] = {}
        self.order = asyncio.Lock()  # live frames, replays and fills go out one at a time, in seq order
        self.start_watches: set[asyncio.Task[None]] = set()  # accepted turns not known to have started
        self.offered: set[str] = set()  # streams this socket was offered (resuming): an ACK must name one
        self.begun: set[str] = set()  # requests whose stream a worker opened (think.stream_started)
        self.slot: dict[str, Any] | None = None  # its place among the principal's open sockets
        self.limits, self.bucket, self.throttled = frame_limits(), frame_bucket(), False
        self.send_limit = think_setting("MAX_SEND_BYTES")
        subprotocols = list(self.scope.get("subprotocols") or [])
        await self.accept(subprotocols[0] if subprotocols else None)
        try:
            agent_class(self.agent_name)
        except UnknownAgent:
            await self.close(code=CLOSE_UNKNOWN_AGENT, reason=f"unknown agent {self.agent_name!r}")
            return
        problem = conversation_name_problem(self.instance_name)
        if problem is not None:
            await self.close(code=CLOSE_BAD_NAME, reason=problem)
            return
        try:  # the only door: every frame after this acts on the conversation checked here
            policy = access_policy()
            principal = await web_db(policy.principal)(Credentials.from_scope(self.scope))
            if not await self._take_slot(principal):
                return
            conversation = await web_db(conversation_open_as)(
                agent=self.agent_name,
                name=self.instance_name,
                principal=principal,
                policy=policy,
                address=self._client_address(),
            )
        except (AccessDenied, ConversationLimit) as exc:
            logger.info("connection refused: %s", exc, extra=self._log_extra())
            await self._release_slot()
            code = CLOSE_TOO_MANY_CONVERSATIONS if isinstance(exc, ConversationLimit) else CLOSE_FORBIDDEN
            await self.close(code=code, reason=str(exc))
            return
        self.principal = principal
        self.conversation_id = conversation.pk
        self.group = group_name(conversation.pk)
        # Join before reading state, so nothing published after the read can be missed.
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self._send_connect_frames()

    async def _take_slot(self, principal: str) -> bool:
        """A place among the principal's open sockets (and its address's, when anonymous), renewed while
        the socket is open; closed 4429 when there is none."""
        address = self._client_address()
        if not socket_slots_counted(principal, address):  # no bound: no slot, and no hop to take one
            return True
        slot: dict[str, Any] = {"principal": principal, "address": address, "socket": self.channel_name}
        refused = await sync_to_async(socket_slot_take, thread_sensitive=False)(**slot)
        if refused:
            logger.warning("connection refused: %s", refused, extra=self._log_extra())
            await self.close(code=CLOSE_TOO_MANY_SOCKETS, reason=refused)
            return False
        self.slot = slot
        self.slot_renewal = asyncio.create_task(self._renew_slot())
        return True

    async def _renew_slot(self) -> None:
        while True:
            await asyncio.sleep(SOCKET_RENEW_S)
            assert self.slot is not None
            await sync_to_async(socket_slot_renew, thread_sensitive=False)(**self.slot)

    async def _release_slot(self) -> None:
        if self.slot is not None:
            self.slot_renewal.cancel()
            slot, self.slot = self.slot, None
            await sync_to_async(socket_slot_release, thread_sensitive=False)(**slot)

    def _offer(self, request_id: str) -> None:
        """This socket is told to ACK this stream (cf_agent_stream_resuming): its ACK is honoured."""
        if len(self.offered) >= SENT_SEQ_MEMORY:
            self.offered.clear()
        self.offered.add(request_id)

    async def _send_connect_frames(self) -> None:
        state = await web_db(connect_state)(conversation_id=self.conversation_id)
        if state.active_request_id is not None:
            self.pending_resume = state.active_request_id
            self._offer(state.active_request_id)
            await self.send(p.stream_resuming_frame(state.active_request_id))
        else:
            assert state.window is not None
            await self.send(p.chat_messages_frame(state.window.messages, earlier=state.window.earlier))
            if state.pending_request_id is not None:
                self.parked = True
                await self.send(p.stream_pending_frame(state.pending_request_id))
            if state.recovering:
                await self.send(p.recovering_frame(True, state.recovering.get("requestId")))
        await self.send(p.identity_frame(self.instance_name, self.agent_name))

    async def disconnect(self, code: int) -> None:
        # A closed socket never stops a turn: the worker keeps streaming to the group and the database.
        silence.unwatch(self)
        for watch in self.start_watches:
            watch.cancel()
        await self._release_slot()
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    # -- client frames -----------------------------------------------------------------------------
    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if text_data is None or not hasattr(self, "conversation_id"):
            return  # binary frames are not part of the protocol; a refused connection is closing
        if not self.bucket.take():
            if not self.throttled:  # once per flood, not once per frame
                logger.warning("frames over the rate limit refused", extra=self._log_extra())
            self.throttled = True
            await self._refuse(text_data, f"Chat request refused: {self._rate_text()}")
            return
        self.throttled = False
        try:
            frame = p.parse_frame(text_data, self.limits)
        except p.ProtocolError as exc:
            level = logging.WARNING if isinstance(exc, p.LimitExceeded) else logging.INFO
            logger.log(level, "frame refused: %s", exc, extra=self._log_extra())
            if isinstance(exc, AnswerRefused):
                await self.send(p.tool_refused_frame(exc.tool_call_id, str(exc)))
            await self._refuse(text_data, f"Invalid chat request: {exc}")
            return
        if frame is None:
            logger.debug("unknown frame type ignored", extra=self._log_extra())
            return
        handler = getattr(self, f"on_{type(frame).__name__.lower()}", None)
        if handler is not None:
            await handler(frame)

    async def _refuse(self, text: str, body: str) -> None:
        """A refused chat request still ends its client stream, with the reason as an error; other
        frames have no error frame in the protocol (the log line is all)."""
        request_id = p.refused_request_id(text)
        if request_id is not None:
            await self.send(p.response_frame(request_id, body, done=True, error=True))

    def _rate_text(self) -> str:
        return f"more than {self.bucket.rate:g} frames a second (after a burst of {self.bucket.burst})"

    async def on_chatrequest(self, frame: p.ChatRequest) -> None:
        agent = agent_class(self.agent_name)
        # The notice's clock starts at receipt: under a burst the accept itself waits for one of the
        # process's database threads (chat.wire.pool), busy with the other consumers' calls.
        started: asyncio.Future[Any] = asyncio.get_running_loop().create_future()  # fiber id, or None
        watch = asyncio.create_task(self._watch_start(frame.id, started))
        self.start_watches.add(watch)
        watch.add_done_callback(self.start_watches.discard)
        try:
            await self._accept_turn(frame, agent, started)
        finally:
            if not started.done():  # not a turn that should start now: nothing more to tell
                started.set_result(None)

    async def _accept_turn(
        self, frame: p.ChatRequest, agent: type[Any], started: asyncio.Future[Any]
    ) -> None:
        accepted = await web_db(turn_accept)(
            conversation_id=self.conversation_id,
            request=frame,
            policy=agent.message_concurrency,
            client_history=agent.accept_client_history,
            address=self._client_address(),
            announce=accept_announcer(self.conversation_id, exclude=[self.channel_name]),
        )
        if accepted.duplicate:
            return
        if accepted.refused:
            logger.warning("chat request refused: %s", accepted.refused, extra=self._log_extra())
            body = f"Chat request refused: {accepted.refused}"
            await self.send(p.response_frame(frame.id, body, done=True, error=True))
            return
        if accepted.dropped:  # roll the client back to the server's transcript, end its stream
            await self.send(await web_db(_transcript)(self.conversation_id))
            await self.send(p.response_frame(frame.id, done=True, outcome="skipped"))
            return
        if accepted.ahead:  # it runs after the turns before it
            await self._tell_queued(p.chat_queued_frame(frame.id, p.QUEUED_BEHIND_TURNS, accepted.ahead))
        else:
            started.set_result(accepted.fiber_id)

    async def _watch_start(self, request_id: str, started: asyncio.Future[Any]) -> None:
        """Tell the clients that the turn waits if QUEUED_NOTICE_MS after its request came nothing of
        it was sent: for the server while it is still being accepted, then for a worker while no
        worker has begun it: its stream is not open (no think.stream_started came, nothing of it was
        sent). Read from what the socket heard, not from Postgres: a query per turn was 8% of the web
        process's Python time in a burst; a start event the layer lost costs a needless notice."""
        await asyncio.sleep(float(think_setting("QUEUED_NOTICE_MS")) / 1000)
        if not started.done():  # the sender only: the other tabs have not been shown the request yet
            await self.send(p.chat_queued_frame(request_id, p.QUEUED_FOR_SERVER))
        fiber_id = await started
        if fiber_id is None or request_id in self.sent_seq or request_id in self.begun:
            return
        await self._tell_queued(p.chat_queued_frame(request_id, p.QUEUED_FOR_WORKER))

    async def _tell_queued(self, frame: str) -> None:
        """The sender straight away (the channel layer may drop under load), the other tabs through it."""
        await self.send(frame)
        await self._group_broadcast(frame, exclude=[self.channel_name])

    async def on_cancel(self, frame: p.Cancel) -> None:
        running = await web_db(turn_cancel)(conversation_id=self.conversation_id, request_id=frame.id)
        if not running:  # nothing streams for it: end the client's stream ourselves
            await self.send(p.response_frame(frame.id, done=True, outcome="aborted"))
            if not await web_db(conversation_busy)(self.conversation_id):
                await release_parked(self.conversation_id)  # no turn left to wait for

    async def on_stop(self, frame: p.Stop) -> None:
        """Stop everything of the conversation (chat.turn.actions): every tab hears of it, this one too."""
        await astop_conversation(self.conversation_id)

    async def on_switchbranch(self, frame: p.SwitchBranch) -> None:
        """Bring back another branch (chat.transcript.branches); every tab gets the transcript."""
        try:
            await aswitch_branch(self.conversation_id, frame.anchor_id, frame.index)
        except (BranchNotFound, ConversationBusy) as exc:
            logger.info("branch switch refused: %s", exc, extra=self._log_extra())
            await self.send(p.branch_refused_frame(frame.anchor_id, frame.index, str(exc)))

    async def on_toolresult(self, frame: p.ToolResult) -> None:
        result = await web_db(tool_result_apply)(
            conversation_id=self.conversation_id,
            result=frame,
            server_tools=await web_db(server_tool_names)(
                self.agent_name, self.instance_name, self.conversation_id
            ),
            owner=self.channel_name,
            announce=announcer(self.conversation_id),
            address=self._client_address(),
        )
        await self._interaction_applied(result, frame.tool_call_id)

    async def on_toolapproval(self, frame: p.ToolApproval) -> None:
        result = await web_db(tool_approval_apply)(
            conversation_id=self.conversation_id,
            approval=frame,
            owner=self.channel_name,
            announce=announcer(self.conversation_id),
            address=self._client_address(),
        )
        await self._interaction_applied(result, frame.tool_call_id)

    async def _interaction_applied(self, result: InteractionResult, tool_call_id: str) -> None:
        if result.status == "unknown":
            logger.info("answer for unknown tool call %s ignored", tool_call_id, extra=self._log_extra())
        if result.status == "refused":  # nothing of it was stored: the sender hears why
            await self.send(p.tool_refused_frame(tool_call_id, result.problem))
        if result.refused:  # the answer is stored; the turn it would continue is over a limit
            logger.warning("continuation refused: %s", result.refused, extra=self._log_extra())
            refusal = f"Continuation refused: {result.refused}"
            request_id = f"refused-{uuid.uuid4()}"
            await self.send(p.response_frame(request_id, refusal, done=True, error=True, continuation=True))

    def _client_address(self) -> str | None:
        """The client's address as the ASGI server saw it (behind a proxy: daphne --proxy-headers)."""
        client = self.scope.get("client")
        return str(client[0]) if client else None

    async def on_clear(self, frame: p.Clear) -> None:
        await web_db(conversation_clear)(conversation_id=self.conversation_id)
        self.pending_resume, self.parked = None, False
        self.sent_seq.clear()
        self.following.clear()
        await self._group_broadcast(p.chat_clear_frame(), exclude=[self.channel_name])
        await release_parked(self.conversation_id)

    async def on_resumerequest(self, frame: p.ResumeRequest) -> None:
        answer = await web_db(probe_answer)(
            conversation_id=self.conversation_id, channel_name=self.channel_name
        )
        if answer.kind == "resuming":
            assert answer.request_id is not None
            self.pending_resume = answer.request_id
            self._offer(answer.request_id)
            await self.send(p.stream_resuming_frame(answer.request_id, frame.probe_id))
        elif answer.kind == "pending":
            self.parked = True
            await self.send(p.stream_pending_frame(answer.request_id, frame.probe_id))
        else:  # "idle", or "continuation-owned": another tab answered the tool and follows its turn
            await self.send(p.stream_resume_none_frame(answer.kind, frame.probe_id))

    async def on_resumeack(self, frame: p.ResumeAck) -> None:
        """Replay a stream this socket was offered (once per offer), within the principal's replays."""
        if frame.id not in self.offered:
            logger.info("resume ACK for a stream never offered ignored", extra=self._log_extra())
            return
        self.offered.discard(frame.id)
        refused = await sync_to_async(replay_refusal, thread_sensitive=False)(self.principal)
        if refused:
            logger.warning("replay refused: %s", refused, extra=self._log_extra())
            await self.send(p.response_frame(frame.id, f"Resume refused: {refused}", done=True, error=True))
            return
        if self.pending_resume == frame.id:
            self.pending_resume = None
        async with self.order:  # live frames wait, so replay and the live tail cannot interleave
            replay = await web_db(ack_replay)(conversation_id=self.conversation_id, request_id=frame.id)
            if replay.ignore:
                return
            for text in replay.frames:
                await self.send(text)
            pages = replay.pages
            while pages is not None:  # a long stream: the rest of its stored chunks, a page at a time
                page, pages = await web_db(replay_page)(pages)
                for text in page:
                    await self.send(text)
            for text in replay.closing:
                await self.send(text)
            self._mark_sent(frame.id, replay.last_seq)
            if replay.live:
                self._heard(frame.id)
        if replay.snapshot is not None:  # after the end frame, which lifts the hook's stream guard
            await self.send(_frame(replay.snapshot))
        if replay.messages is not None:
            await self._group_broadcast(_frame(replay.messages), exclude=[])

    # -- group events --------------------------------------------------------------------------------
    async def think_frames(self, event: dict[str, Any]) -> None:
        request_id = event["request_id"]
        if request_id == self.pending_resume:
            return
        async with self.order:
            sent = [await self._send_in_order(request_id, seq, text) for seq, text in event["frames"]]
            if any(sent):  # late copies of frames sent already say nothing of the stream
                self._heard(request_id)

    async def think_stream_started(self, event: dict[str, Any]) -> None:
        if len(self.begun) >= SENT_SEQ_MEMORY:
            self.begun.clear()
        self.begun.add(event["request_id"])
        if self.parked:
            self.parked = False
            self.pending_resume = event["request_id"]
            self._offer(event["request_id"])
            await self.send(p.stream_resuming_frame(event["request_id"]))

    async def think_stream_end(self, event: dict[str, Any]) -> None:
        request_id = event["request_id"]
        if request_id == self.pending_resume:
            self.pending_resume = None  # it will ACK and get the finished stream replayed
        else:
            async with self.order:
                await self._send_in_order(request_id, event["seq"], event["frame"])
                self.following.pop(request_id, None)

    async def think_broadcast(self, event: dict[str, Any]) -> None:
        if self.channel_name not in event.get("exclude", ()):
            await self.send(event["frame"])

    async def think_release_parked(self, event: dict[str, Any]) -> None:
        if self.parked:
            self.parked = False
            await self.send(p.stream_resume_none_frame())

    # -- ordering -----------------------------------------------------------------------------------
    async def _send_in_order(self, request_id: str, seq: int, text: str) -> bool:
        last = self.sent_seq.get(request_id, -1)
        if seq <= last:
            return False  # already sent, by replay or by an earlier event
        if seq > last + 1:
            await self._fill_gap(request_id, last, seq)
            STREAM_FILLS.labels("gap").inc()
        await self.send(text)
        self._mark_sent(request_id, seq)
        return True

    async def _fill_gap(self, request_id: str, last: int, upto: int) -> None:
        """Frames the channel layer did not deliver (dropped, or sent before we joined) come from Postgres."""
        stream = await web_db(stream_for_request)(conversation_id=self.conversation_id, request_id=request_id)
        if stream is None:
            return
        chunks = await web_db(stream_chunks)(stream.pk, after_seq=last)
        for seq, body in chunks:
            if seq >= upto:
                break
            await self.send(p.response_frame(request_id, body, seq=seq, continuation=stream.is_continuation))

    # -- silence (chat.wire.silence) -----------------------------------------------------------------------
    def _heard(self, request_id: str) -> None:
        """A frame of a stream this connection follows live went out: look it up after a silence."""
        if request_id not in self.following:
            silence.watch(self)
        wait = silence.silence_wait()
        self.following[request_id] = [time.monotonic() + wait, wait]

    async def look_for_silence(self, now: float) -> None:
        for request_id, (due, _) in list(self.following.items()):
            if due <= now:
                async with self.order:
                    if request_id in self.following:  # not ended while this waited
                        await self._fill_silence(request_id)

    async def _fill_silence(self, request_id: str) -> None:
        """What the store holds past the last chunk sent: chunks, and the end and the transcript once
        the stream has ended. Nothing new: looked up again after twice the wait (a stalled model)."""
        tail = await web_db(stream_tail)(
            conversation_id=self.conversation_id,
            request_id=request_id,
            after_seq=self.sent_seq.get(request_id, -1),
        )
        for seq, text in tail.frames:
            await self.send(text)
            self._mark_sent(request_id, seq)
        if tail.end is not None or tail.gone:
            self.following.pop(request_id, None)
        if tail.end is not None:
            seq, text = tail.end
            if seq > self.sent_seq.get(request_id, -1):
                await self.send(text)
                self._mark_sent(request_id, seq)
            if tail.snapshot is not None:
                await self.send(_frame(tail.snapshot))
        if tail.frames or tail.end is not None:
            STREAM_FILLS.labels("silence").inc()
            logger.info(
                "stream %s was silent: %s chunks%s filled from Postgres",
                request_id,
                len(tail.frames),
                " and its end" if tail.end is not None else "",
                extra=self._log_extra(),
            )
        if tail.end is None and not tail.gone:
            if tail.frames:
                self._heard(request_id)
            else:
                wait = min(self.following[request_id][1] * 2, silence.SILENCE_MAX_WAIT_S)
                self.following[request_id] = [time.monotonic() + wait, wait]

    def _mark_sent(self, request_id: str, seq: int) -> None:
        self.sent_seq[request_id] = max(seq, self.sent_seq.get(request_id, -1))
        self.sent_seq.move_to_end(request_id)
        while len(self.sent_seq) > SENT_SEQ_MEMORY:
            self.sent_seq.popitem(last=False)

    async def _group_broadcast(self, frame: str, *, exclude: list[str]) -> None:
        await self.channel_layer.group_send(
            self.group, {"type": "think.broadcast", "frame": frame, "exclude": exclude}
        )

    def _log_extra(self) -> dict[str, Any]:
        return {"conversation_id": getattr(self, "conversation_id", None), "agent": self.agent_name}


def _transcript(conversation_id: int) -> str:
    return transcript_frame(conversation_id=conversation_id)


def _frame(window: Window) -> str:
    return p.chat_messages_frame(window.messages, earlier=window.earlier)
