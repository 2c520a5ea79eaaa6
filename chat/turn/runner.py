"""The turn runner: one model call streamed durably, on the worker's event loop.

The runner claims the fiber, opens the stream, folds provider deltas into UI chunks, hands them to the
stream writer (which persists then publishes), keeps the lease alive, and finishes the turn in one
fenced transaction. Losing the lease stops it without another write or frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from decimal import Decimal
from typing import Any

from recovery.engine.spine import arecover_fiber
from recovery.exceptions import LeaseLost
from recovery.lease import control, liveness
from recovery.lease.fibers import (
    Claim,
    fiber_claim,
    fiber_interrupt,
    fiber_release,
    fiber_spend_add,
    worker_identity,
)
from recovery.models import Fiber, Stream
from recovery.observe import diagnostics
from recovery.process.runtime import DATABASE_LOST, db, maybe_await
from recovery.stream.buffer import StreamWriter, stream_close, stream_open
from recovery.stream.flusher import flusher

from .. import broadcast
from ..conf import think_setting
from ..exceptions import StreamStalled
from ..models import Conversation
from ..protocol import chunk_framer, response_frame
from ..transcript.finish import TurnOutcome, turn_finish
from ..transcript.folding import MessageAccumulator
from ..transcript.repair import repair_transcript
from ..transcript.selectors import messages_list, stream_partial
from ..transcript.services import transcript_repair_save
from ..transcript.snapshot import FiberSnapshot
from ..types import Chunk, UIMessage
from . import errors, faults, llm, tracing
from .agent import ChunkCallback, Think, TurnContext, current_agent_var
from .chunking import UI_CHUNK_POLICY
from .context import run_context_load
from .continuation import settle_recovered_turn
from .llm import Usage
from .loop import ModelLoop
from .mcp import MCPServer, MCPToolbox, mcp_server_list
from .overflow import CONTEXT_OVERFLOW, ChatErrorContext, classify, compact_for_overflow
from .registry import agent_for
from .tools import Tool, Toolset

logger = logging.getLogger(__name__)

LIVENESS_WAIT_S = 1.0
# What a turn needs of its conversation to start, read by the claim while it holds the row's lock.
CLAIM_FIELDS = ("agent", "name", "last_client_tools")
# Runners of this process, so a worker shutdown can hand every turn to recovery at once.
ACTIVE: set[asyncio.Task[None]] = set()


async def turn_run(fiber_id: str, *, on_chunk: ChunkCallback | None = None) -> TurnRunner | None:
    """Run the turn of a fiber; a duplicate delivery, or a fiber that is not pending, does nothing."""
    loop = asyncio.get_running_loop()
    signal = _CancelSignal()
    # Listening before the claim: a cancel can only be signalled once the claim has committed.
    control.watch(fiber_id, lambda: loop.call_soon_threadsafe(signal.fire))
    try:
        # The claim records this process's liveness key while it holds its session (recovery.lease.liveness);
        # right after start-up it waits an instant for it, so the turn is watched by both detectors.
        await liveness.wait_held(LIVENESS_WAIT_S)
        claim = await db(
            fiber_claim,
            fiber_id=fiber_id,
            owner=worker_identity(),
            fields=CLAIM_FIELDS,
            session=liveness.session_key(),
        )
        if claim is None:
            logger.info("fiber %s not claimed (already taken, finished, or waiting its turn)", fiber_id)
            return None
        task = asyncio.current_task()
        assert task is not None
        ACTIVE.add(task)
        runner = TurnRunner(claim, on_chunk=on_chunk)
        signal.attach(runner)
        try:
            async with tracing.turn_span(runner):
                await runner.run()
        finally:
            ACTIVE.discard(task)
        return runner
    finally:
        control.unwatch(fiber_id)


class _CancelSignal:
    """Delivers a cancel signal to the runner of a fiber, also one that arrives before it exists."""

    def __init__(self) -> None:
        self.runner: TurnRunner | None = None
        self.fired = False

    def fire(self) -> None:
        self.fired = True
        if self.runner is not None:
            self.runner.stop_for_cancel()

    def attach(self, runner: TurnRunner) -> None:
        self.runner = runner
        if self.fired:
            runner.stop_for_cancel()


def shutdown_all() -> int:
    """Cancel every turn of this process; each persists its buffer and lets recovery take over."""
    for task in list(ACTIVE):
        task.get_loop().call_soon_threadsafe(task.cancel)
    return len(ACTIVE)


def _stored_message(stream_id: Any) -> MessageAccumulator:
    return stream_partial(Stream.objects.get(pk=stream_id))[0]


class TurnRunner:
    def __init__(self, claim: Claim, *, on_chunk: ChunkCallback | None = None) -> None:
        self.claim = claim
        self.on_chunk = on_chunk
        self.conversation_id = claim.conversation_id
        self.request_id = claim.request_id
        stored = FiberSnapshot.from_json(claim.snapshot)
        turn = stored.turn
        self.continuation = turn is not None and turn.continuation
        self.incident_id: str | None = turn.incident_id if turn is not None else None
        # A recovered turn of a model_reattach agent: the provider generation its first step rejoins.
        self.reattach = llm.ResponseCursor.from_json(stored.cursor)
        # A continuation extends the assistant message it continues (set in run); others write a new one.
        self.extends_id: str | None = turn.extends_assistant_message if turn is not None else None
        self.message_id = self.extends_id or str(uuid.uuid4())
        self.base_message: UIMessage | None = None
        self.accumulator = MessageAccumulator(self.message_id)
        self.writer: StreamWriter | None = None
        self.stream_id: Any = None
        self.stop_reason: str | None = None  # "cancel", "lease" or "database"
        self.handed_over: str | None = None  # why the turn went to recovery itself ("stalled", "shutdown")
        self.output_tokens = 0  # what the model reported for this run's steps (principal usage)
        self.producer: asyncio.Task[None] | None = None
        self.outcome = "interrupted"  # until the turn finishes
        self.classification: str | None = None
        self.log_extra = {"conversation_id": claim.conversation_id, "request_id": claim.request_id}

    async def run(self) -> None:
        conversation = self.claim.conversation  # as the claim found it, locked
        messages = await db(messages_list, conversation_id=self.conversation_id)
        agent = agent_for(conversation["agent"], conversation["name"], self.conversation_id)
        if self.extends_id is not None and not any(m["id"] == self.extends_id for m in messages):
            self.extends_id = None  # the message it continued is gone: the continuation is a new one
            self.message_id = str(uuid.uuid4())
            self.accumulator = MessageAccumulator(self.message_id)
        self.client_tools = conversation.get("last_client_tools")
        try:
            await self._open_stream()
        except LeaseLost:
            logger.warning("fiber lost before its stream opened", extra=self.log_extra)
            return
        await broadcast.publish_stream_started(self.conversation_id, self.request_id)
        self.agent = agent
        started = time.monotonic()
        self._emit_event(
            "fiber:run:started", {"fiberId": str(self.claim.fiber_id), "fiberName": self.fiber_name}
        )
        self._emit_event(
            "chat:turn:start",
            {"requestId": self.request_id, "trigger": self.claim.kind, "continuation": self.continuation},
        )
        agent.turn = TurnContext(self.claim.fiber_id, self.claim.fencing, self.request_id)
        token = current_agent_var.set(agent)
        try:
            await self._supervise(agent, messages)
        finally:  # also when the worker stops mid-turn: the turn ends here as "interrupted"
            if self.writer is not None:
                flusher().unregister(self.writer)
            current_agent_var.reset(token)
            agent.turn = agent.context = None
            self._emit_event(
                "chat:turn:finish",
                {
                    "requestId": self.request_id,
                    "status": self.outcome,
                    "durationMs": int((time.monotonic() - started) * 1000),
                },
            )

    async def _open_stream(self, next_seq: int = 0) -> None:
        """Open the turn's stream (again after a reactive overflow retry: seq carries on)."""
        self.stream_id = await db(
            stream_open,
            conversation_id=self.conversation_id,
            fiber_id=self.claim.fiber_id,
            fencing=self.claim.fencing,
            request_id=self.request_id,
            message_id=self.message_id,
            continuation=self.continuation,
        )
        if self.writer is not None:  # an overflow retry: the first stream's writer is done
            flusher().unregister(self.writer)
        self.writer = StreamWriter(
            stream_id=self.stream_id,
            fiber_id=self.claim.fiber_id,
            fencing=self.claim.fencing,
            frame=chunk_framer(self.request_id, continuation=self.continuation),
            policy=UI_CHUNK_POLICY,
            fanout=(self.conversation_id, self.request_id),
        )
        self.writer.next_seq, self.writer.stored_seq = next_seq, next_seq - 1
        self.writer.on_stop = self._writer_stopped
        # The process's flusher stores its chunks and keeps its lease from here on.
        flusher().register(self.writer)

    @property
    def fiber_name(self) -> str:
        return f"__think_chat_turn:{self.request_id}"

    def _emit_event(self, event_type: str, payload: dict[str, Any]) -> None:
        diagnostics.emit(event_type, payload, agent=self.agent.agent, name=self.agent.name)

    def stop_for_cancel(self) -> None:
        """A cancel was signalled: stop producing now; nothing produced from here on is stored or sent."""
        if self.stop_reason is not None:
            return
        self.stop_reason = "cancel"
        if self.writer is not None:
            self.writer.cancel_requested = True
        if self.producer is not None and not self.producer.done():
            self.producer.cancel()

    def _writer_stopped(self, reason: str, error: BaseException | None) -> None:
        """The flusher found the turn must stop: a cancel, a lost lease, or a lost database."""
        if reason == "cancel":
            self.stop_for_cancel()
            return
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        if reason == "database":  # as in _supervise: stop, and let the lease lapse
            logger.warning("database lost mid-turn: %s", error, extra=self.log_extra)
        if self.producer is not None and not self.producer.done():
            self.producer.cancel()

    async def _supervise(self, agent: Think, messages: list[UIMessage]) -> None:
        if self.stop_reason == "cancel":  # signalled before the model was called
            await self._finish(None)
            return
        producer = self.producer = asyncio.create_task(self._produce(agent, messages))
        error: BaseException | None = None
        try:
            await producer
        except asyncio.CancelledError:
            if self.stop_reason is None:  # the worker itself is stopping: hand the turn to recovery
                await self._abandon()
                raise
        except LeaseLost:
            self.stop_reason = "lease"
        except DATABASE_LOST as exc:
            # Postgres went away: nothing more can be stored, so the turn is not finished either (that
            # would fail, or, with Postgres back, store the outage as the turn's error); its lease
            # lapses and recovery continues it from what was stored.
            self.stop_reason = "database"
            logger.warning("database lost mid-turn: %s", exc, extra=self.log_extra)
        except StreamStalled as stall:
            await self._hand_to_recovery(stall, reason="stalled")
            return
        except MemoryError as exc:
            await self._hand_to_recovery(exc, reason="out_of_memory")
            return
        except Exception as exc:
            error = exc
        if self.stop_reason == "lease":
            logger.warning("fiber lease lost; the turn stops without writing", extra=self.log_extra)
            return
        if self.stop_reason == "database":
            return
        kind = self._recoverable(agent, error) if error is not None else None
        if kind is not None:
            assert error is not None
            await self._hand_to_recovery(error, reason=kind, retry_after_s=errors.retry_after_s(error))
            return
        await self._finish(error)

    def _recoverable(self, agent: Think, error: BaseException) -> str | None:
        """The error's kind ("rate_limit", "transient") when recovery takes the failed turn over, else None.

        Recovery continues it from what was stored, after a wait, within the incident budget. An agent
        whose recovers_model_errors() is False (`chat_recovery = False`) ends such a turn at once instead.
        """
        if (
            self.stop_reason is not None
            or self.classification is not None
            or not agent.recovers_model_errors()
        ):
            return None
        kind = classify(agent, error, stage="stream", request_id=self.request_id)
        return kind if kind in errors.RECOVERABLE else None

    async def _produce(self, agent: Think, messages: list[UIMessage]) -> None:
        agent.context = await db(
            run_context_load,
            agent=agent,
            conversation_id=self.conversation_id,
            request_id=self.request_id,
            incident_id=self.incident_id,
        )
        own = list(agent.get_tools())
        servers = await _mcp_servers(agent)
        taken = {t.name for t in own if isinstance(t, Tool)}  # Toolset refuses anything else
        async with MCPToolbox(servers, taken=taken, agent=agent) as mcp_tools:
            toolset = Toolset([*own, *mcp_tools], self.client_tools)
            await self._produce_with(agent, messages, toolset)

    async def _produce_with(self, agent: Think, messages: list[UIMessage], toolset: Toolset) -> None:
        overflow = agent.get_context_overflow()
        attempt = 0
        while True:
            messages = await self._repair(agent, messages)
            messages = self._extend(messages)
            loop = ModelLoop(
                agent=agent,
                messages=messages,
                toolset=toolset,
                accumulator=self.accumulator,
                continuation=self.continuation,
                request_id=self.request_id,
                emit=self._emit,
                proactive=overflow.proactive if overflow else None,
                reattach=self.reattach,
                note_cursor=self._note_cursor,
                extends=self.extends_id if self.base_message is not None else None,
                on_spend=self._spend,
            )
            self.reattach = None  # a second run of the loop (overflow retry) starts a new generation
            try:
                await loop.run()
                return
            except Exception as exc:
                if not await self._overflow_retry(agent, exc, attempt):
                    raise
            finally:
                self.output_tokens += loop.output_tokens
            attempt += 1
            messages = await db(messages_list, conversation_id=self.conversation_id)

    def _extend(self, messages: list[UIMessage]) -> list[UIMessage]:
        """The history the model loop sees; a continuation's message moves into the accumulator.

        The continuation folds its chunks onto that message (as clients do, told by
        `continuation: true`) and stores it whole when it finishes; the model sees the history
        before it, then the message as the accumulator holds it. Messages queued after it are
        answered by their own turns.
        """
        if self.extends_id is None:
            return messages
        index = next((i for i, m in enumerate(messages) if m["id"] == self.extends_id), None)
        history = messages
        if index is not None:
            self.base_message, history = messages[index], messages[:index]
        # (A compaction between two attempts may hide it: the attempt extends the copy seen first.)
        if self.base_message is not None:
            self.accumulator = MessageAccumulator.extending(self.base_message)
        return history

    async def _overflow_retry(self, agent: Think, error: Exception, attempt: int) -> bool:
        """Reactive layer: drop the partial, compact, and run the same turn again."""
        overflow = agent.get_context_overflow()
        if overflow is None or not overflow.reactive or isinstance(error, LeaseLost | StreamStalled):
            return False
        if classify(agent, error, stage="stream", request_id=self.request_id) != CONTEXT_OVERFLOW:
            return False
        self.classification = CONTEXT_OVERFLOW  # the partial is never kept, and the error says why
        if attempt >= overflow.max_retries:
            return False
        if not await compact_for_overflow(agent, "reactive", request_id=self.request_id, attempt=attempt + 1):
            return False
        await self._restart_stream()
        self.classification = None
        return True

    async def _restart_stream(self) -> None:
        """A fresh message on a fresh stream under the same request id; clients get no `done` between."""
        assert self.writer is not None
        await self.writer.flush()
        await db(stream_close, stream_id=self.stream_id, status=Stream.Status.COMPLETED)
        if self.extends_id is None:
            self.message_id = str(uuid.uuid4())
        self.accumulator = MessageAccumulator(self.message_id)  # a continuation's is reset by _extend
        await self._open_stream(next_seq=self.writer.next_seq)

    async def _repair(self, agent: Think, messages: list[UIMessage]) -> list[UIMessage]:
        """Repair interrupted tool calls before the model sees the transcript; persisted, fenced."""
        report = repair_transcript(messages, agent.repair_interrupted_tool_part)
        if not report.any:
            return messages
        await db(
            transcript_repair_save,
            fiber_id=self.claim.fiber_id,
            fencing=self.claim.fencing,
            conversation_id=self.conversation_id,
            messages=report.changed,
        )
        self._emit_event("chat:transcript:repaired", report.event())
        await broadcast.publish_transcript(self.conversation_id)
        return report.messages

    def _note_cursor(self, cursor: dict[str, Any]) -> None:
        assert self.writer is not None
        self.writer.note_cursor(cursor)

    async def _spend(self, step: int, usage: Usage, cost: Decimal | None) -> None:
        """A step ended: its spend goes on the fiber (fenced, so an attempt's spend counts against its
        recovery's budget even if a later step dies), then to the diagnostics channel and metrics. A
        failed write costs the record, never the turn."""
        try:
            await db(
                fiber_spend_add,
                fiber_id=self.claim.fiber_id,
                fencing=self.claim.fencing,
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                cost=cost,
            )
        except Exception as exc:
            logger.warning("step spend not recorded: %s", exc, extra=self.log_extra)
        self._emit_event(
            "chat:step:usage",
            {
                "requestId": self.request_id,
                "step": step,
                "inputTokens": usage.prompt_tokens,
                "outputTokens": usage.completion_tokens,
                "cachedTokens": usage.cached_tokens,
                "cost": str(cost) if cost is not None else None,
            },
        )

    async def _emit(self, chunk: Chunk, cursor: dict[str, Any] | None = None) -> None:
        assert self.writer is not None
        self.accumulator.apply(chunk)
        if self.writer.add(chunk, cursor):
            # Stored before the turn goes on (first content, tool milestones, a backlog of full
            # batches); the write runs in the flusher, so a cancel arriving meanwhile cannot leave a
            # committed segment unpublished.
            await self.writer.flush()
        if self.on_chunk is not None:
            await maybe_await(self.on_chunk(chunk))

    async def _error_text(self, error: BaseException) -> str:
        """What clients see of the turn's error: the string on_chat_error returns, or else a generic text
        naming the error's class and its fault (recorded with the details, chat.turn.faults)."""
        classification = self.classification or classify(
            self.agent, error, stage="stream", request_id=self.request_id
        )
        _, reference = await faults.turn_fault(
            error,
            conversation_id=self.conversation_id,
            fiber_id=self.claim.fiber_id,
            request_id=self.request_id,
            log_extra=self.log_extra,
        )
        context = ChatErrorContext(
            stage="stream", request_id=self.request_id, classification=classification, fault=reference
        )
        try:
            shown = await maybe_await(self.agent.on_chat_error(error, context))
        except Exception:
            logger.exception("on_chat_error raised; the generic text is shown", extra=self.log_extra)
            shown = error
        text = (
            faults.turn_text(shown, classification, reference)
            if isinstance(shown, BaseException)
            else str(shown)
        )
        self._emit_event(
            "chat:request:failed",
            {"requestId": self.request_id, "stage": "stream", "error": text, "fault": reference},
        )
        return text

    def _outcome(self, error: BaseException | None, error_text: str = "") -> tuple[TurnOutcome, str]:
        self.accumulator.close_open_parts()
        keep = self.accumulator.has_content and self.classification != CONTEXT_OVERFLOW
        message = self.accumulator.message() if keep else None
        foreign = list(self.accumulator.foreign_tool_updates)
        spent = self.output_tokens
        if error is not None:
            text = error_text
            outcome = TurnOutcome(Fiber.Status.FAILED, Stream.Status.ERROR, message, text, foreign, spent)
            return outcome, "error"
        if self.stop_reason == "cancel":
            return TurnOutcome(
                Fiber.Status.CANCELLED, Stream.Status.COMPLETED, message, None, foreign, spent
            ), "aborted"
        return TurnOutcome(
            Fiber.Status.COMPLETED, Stream.Status.COMPLETED, message, None, foreign, spent
        ), "completed"

    async def _finish(self, error: BaseException | None) -> None:
        assert self.writer is not None
        text = await self._error_text(error) if error is not None else ""
        try:
            if self.stop_reason != "cancel":
                await self.writer.flush()
            if self.stop_reason == "cancel" or self.writer.cancel_requested:
                # Stopped: the answer is what was stored (and so sent), not what the model made since.
                self.stop_reason, error = "cancel", None
                await self.writer.stop()
                if think_setting("STREAM_PERSIST"):
                    self.accumulator = await db(_stored_message, self.stream_id)
            outcome, wire_outcome = self._outcome(error, text)
            await db(
                turn_finish,
                fiber_id=self.claim.fiber_id,
                fencing=self.claim.fencing,
                conversation_id=self.conversation_id,
                stream_id=self.stream_id,
                outcome=outcome,
            )
        except LeaseLost:
            logger.warning("fiber lease lost while finishing; nothing written", extra=self.log_extra)
            return
        if self.incident_id:  # a recovered turn settles its incident (and the recovering flag) first
            conversation = await db(Conversation.objects.get, pk=self.conversation_id)
            await settle_recovered_turn(
                conversation=conversation, incident_id=self.incident_id, outcome=wire_outcome
            )
        self.outcome = wire_outcome
        event = "fiber:run:completed" if wire_outcome != "error" else "fiber:run:failed"
        self._emit_event(event, {"fiberId": str(self.claim.fiber_id), "fiberName": self.fiber_name})
        seq = self.writer.next_seq
        done = response_frame(
            self.request_id,
            outcome.terminal or "",
            done=True,
            error=outcome.terminal is not None,
            continuation=self.continuation,
            seq=seq,
            outcome=wire_outcome,
        )
        await broadcast.publish_stream_end(self.conversation_id, self.request_id, seq, done)
        # The stored transcript after the end frame: the published hook keeps its own copy of a
        # message it streams until that frame (even a stopped one), and takes the snapshot after it.
        await broadcast.publish_transcript(self.conversation_id)
        logger.info("turn %s (%s chunks)", wire_outcome, seq, extra=self.log_extra)

    async def _abandon(self) -> None:
        """The worker is shutting down: persist what is buffered and let the lease lapse for recovery."""
        assert self.writer is not None
        self.handed_over = "shutdown"
        with contextlib.suppress(Exception):
            await self.writer.flush()
        with contextlib.suppress(Exception):
            await db(fiber_release, fiber_id=self.claim.fiber_id, fencing=self.claim.fencing)
        logger.warning("worker stopping mid-turn; the fiber is handed to recovery", extra=self.log_extra)

    async def _hand_to_recovery(
        self, cause: BaseException, *, reason: str, retry_after_s: float | None = None
    ) -> None:
        """A stalled stream, a turn out of memory or a transient model error joins the same incident
        budget as a crash."""
        assert self.writer is not None
        self.handed_over = reason
        logger.warning("%s (%s: handed to recovery)", cause, reason, extra=self.log_extra)
        try:
            await self.writer.flush()
        except LeaseLost:
            return
        if await db(fiber_interrupt, fiber_id=self.claim.fiber_id, fencing=self.claim.fencing, reason=reason):
            await arecover_fiber(self.claim.fiber_id, retry_after_s=retry_after_s)


async def _mcp_servers(agent: Think) -> list[MCPServer]:
    """`get_mcp_servers()`: an override runs on a thread (it may read the database, to find a user's token
    say), and may be async; the attribute alone is read as it is."""
    if type(agent).get_mcp_servers is Think.get_mcp_servers:
        return mcp_server_list(agent.get_mcp_servers())
    return mcp_server_list(await maybe_await(await db(agent.get_mcp_servers)))
