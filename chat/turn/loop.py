"""The model/tool loop of one turn: model steps streamed as UI chunks, server tools run between steps.

A step that ends with tool calls runs the server tools and starts the next step with their results;
a client tool or a tool that needs approval ends the turn, and the human's answer continues it later
(see `chat.transcript.interactions`). Tools a human approved earlier run first, before any model call.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from recovery.observe import diagnostics
from recovery.process.runtime import db, maybe_await

from ..conf import think_setting
from ..exceptions import ReattachUnavailable, StreamStalled
from ..transcript.files import Attachment, attachments_for_model, file_id_of
from ..transcript.folding import MessageAccumulator, is_tool_part, tool_name_of
from ..transcript.interactions import result_update
from ..transcript.model_messages import to_model_messages
from ..transcript.repair import INTERRUPTED_TOOL_ERROR as INTERRUPTED
from ..transcript.selectors import messages_list
from ..types import Chunk, UIMessage
from . import faults, llm, tracing
from .chunking import ToolCall, UIChunker
from .llm import Marked, ResponseCursor, TextDelta, Usage
from .overflow import Proactive, compact_for_overflow
from .prefill import prefill_request
from .pricing import needs_litellm, step_cost
from .seam import Seam
from .tools import (
    UNKNOWN_TOOL,
    Tool,
    ToolOutcome,
    Toolset,
    approved_call_problem,
    input_problem,
    tool_execute,
)

if TYPE_CHECKING:
    from .agent import Think

logger = logging.getLogger(__name__)

CONTINUE_PROMPT = "Continue your previous response from exactly where it left off. Do not repeat any of it."

Emit = Callable[..., Awaitable[None]]  # emit(chunk, cursor=None)
NoteCursor = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class StepResult:
    """What one model step did; given to `Think.on_step_finish`."""

    number: int
    finish_reason: str | None
    tool_calls: list[ToolCall]
    waiting_for_human: bool
    prompt_tokens: int | None


# Told each step's number, usage and cost (None: unpriced) once the step ended.
OnSpend = Callable[[int, Usage, Decimal | None], Awaitable[None]]


class ModelLoop:
    def __init__(
        self,
        *,
        agent: Think,
        messages: list[UIMessage],
        toolset: Toolset,
        accumulator: MessageAccumulator,
        continuation: bool,
        request_id: str,
        emit: Emit,
        proactive: Proactive | None = None,
        reattach: ResponseCursor | None = None,
        note_cursor: NoteCursor | None = None,
        extends: str | None = None,
        on_spend: OnSpend | None = None,
    ) -> None:
        """`extends`: the id of the message a continuation extends; the accumulator holds it, and
        `messages` is the history before it."""
        self.agent = agent
        self.extends = extends
        self.proactive = proactive
        self.compactions = 0
        self.messages = messages
        self.toolset = toolset
        self.accumulator = accumulator
        self.continuation = continuation
        self.request_id = request_id
        self.emit = emit
        # The stored generation the first step rejoins instead of calling the model (model_reattach).
        self.reattach = reattach if reattach is not None and not reattach.done else None
        self.note_cursor = note_cursor
        self.model: str | None = None  # the model of the last step, for its span
        self.output_tokens = 0  # the steps' output tokens, as the model reported them
        self.on_spend = on_spend  # each step's usage and cost, as it ends (the runner records them)
        self.files: dict[str, Attachment] = {}  # the bytes of the history's files, by id, read once
        self.seam_due = continuation  # the first model step of a continuation meets the partial's text

    async def _emit_all(self, chunks: list[Chunk], cursor: ResponseCursor | None = None) -> None:
        """Emit chunks; a provider cursor goes with the last of them, so it is stored with it and not
        before (a crash would lose the chunk) nor after (a resume would repeat it)."""
        if cursor is not None and not chunks:
            if self.note_cursor is not None:
                self.note_cursor(cursor.as_json())
            return
        last = len(chunks) - 1
        for index, chunk in enumerate(chunks):
            if cursor is not None and index == last:
                await self.emit(chunk, cursor=cursor.as_json())
            else:
                await self.emit(chunk)

    async def run(self) -> None:
        chunker = UIChunker(self.accumulator.message_id, dynamic=self.toolset.dynamic)
        await self._emit_all(chunker.start(continuation=self.continuation))
        await self._run_approved()
        for number in range(1, int(self.agent.max_steps) + 1):
            if number > 1:
                await self._proactive_compaction(chunker.step_usage)
            elif self.proactive is not None and self.proactive.before_first_step:  # the history's estimate
                await self._proactive_compaction(self._history_estimate())
            await self._emit_all(chunker.step_start())
            with tracing.step_span(number) as span:
                earlier = chunker.step_usage  # a step without usage leaves the last step's in place
                await self._stream_step(chunker)
                usage = chunker.step_usage if chunker.step_usage is not earlier else None
                self.output_tokens += usage.completion_tokens if usage is not None else 0
                if usage is not None:
                    prices = self.agent.get_model_prices()
                    if needs_litellm(prices, self.model):
                        await llm.ensure_litellm()
                    cost = step_cost(prices, self.model, usage)
                    chunker.add_cost(cost)
                    if self.on_spend is not None:
                        await self.on_spend(number, usage, cost)
                tracing.step_ended(span, model=self.model, finish_reason=chunker.finish_reason, usage=usage)
            await self._emit_all(chunker.step_end())
            calls = chunker.take_tool_calls()
            waiting = await self._handle_calls(calls)
            await self.emit({"type": "finish-step"})
            usage = chunker.step_usage
            step = StepResult(
                number, chunker.finish_reason, calls, waiting, usage.prompt_tokens if usage else None
            )
            await maybe_await(self.agent.on_step_finish(step))
            if not calls or waiting:
                break
        await self._emit_all(chunker.finish())

    async def _proactive_compaction(self, usage: Usage | None) -> None:
        """Compact before a step when the previous one came close to the window.

        The history is compacted in place; this turn's own steps are spliced back on, because they
        live in the accumulator and model_messages() appends them to whatever the history is now.
        """
        guard = self.proactive
        if guard is None or self.compactions >= guard.max_compactions or usage is None:
            return
        used = usage.prompt_tokens or usage.total_tokens
        if not used or used < guard.threshold:
            return
        self.compactions += 1  # the attempt counts, even when nothing could be shortened
        try:
            if await compact_for_overflow(self.agent, "proactive"):
                conversation_id = self.agent._require_conversation()
                loaded = await db(messages_list, conversation_id=conversation_id)
                self.messages = self._before_extended(loaded)
        except Exception:
            logger.exception("proactive compaction failed; the step goes on unchanged")

    def _history_estimate(self) -> Usage:
        """The first step's prompt as the session counts tokens (about four characters each, over
        everything the model reads of a message): a history near the window is compacted before the
        provider refuses it, not after."""
        count = self.agent.session.token_counter
        tokens = sum(count(m) for m in self.messages)
        if self.accumulator.has_content:
            tokens += count(self.accumulator.message())
        return Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)

    def _before_extended(self, messages: list[UIMessage]) -> list[UIMessage]:
        """The history before the message a continuation extends (the accumulator holds that one)."""
        index = next((i for i, m in enumerate(messages) if m.get("id") == self.extends), None)
        return messages if index is None else messages[:index]

    def _last_assistant(self) -> UIMessage | None:
        """The message a human answered (approvals, a cut-off tool call): the extended one, if any."""
        if self.extends is not None:
            return self.accumulator.message()
        return next((m for m in reversed(self.messages) if m.get("role") == "assistant"), None)

    async def _load_files(self) -> None:
        """Read the files the history's messages attach that this turn has not read yet (a thread's
        work: storage and database), so the model gets their bytes (chat.transcript.files)."""
        wanted = {
            str(file_id)
            for message in self.messages
            for part in message.get("parts") or ()
            if part.get("type") == "file" and (file_id := file_id_of(str(part.get("url", "")))) is not None
        }
        if wanted - self.files.keys():
            conversation_id = self.agent._require_conversation()
            self.files.update(await db(attachments_for_model, conversation_id, self.messages))

    def model_messages(self) -> list[dict[str, Any]]:
        history = list(self.messages)
        if self.accumulator.has_content:
            history.append(self.accumulator.message())
        model_messages = to_model_messages(
            history,
            system_prompt=self.agent.get_system_prompt(),
            files=self.files,
            max_file_bytes=think_setting("MAX_MODEL_FILE_BYTES"),
        )
        if self.continuation and model_messages and model_messages[-1]["role"] == "assistant":
            if self.agent.get_continuation_style() != "prefill":
                # The provider cannot extend the partial: ask it to continue (never persisted).
                model_messages.append({"role": "user", "content": CONTINUE_PROMPT})
        return model_messages

    def _model_events(self) -> Any:
        tools = self.toolset.schemas() if self.toolset else None
        model = self.agent.completion_kwargs()
        self.model = str(model["model"])
        if not self.agent.model_reattach:
            messages = self.model_messages()
            extra = self._continuation_request(model, messages)
            return llm.stream_chat(
                model=model,
                messages=messages,
                lean=bool(self.agent.lean_model_read),
                **({"tools": tools} if tools else {}),
                **extra,
            )
        resume, self.reattach = self.reattach, None  # only the first step can rejoin a stored generation
        return llm.stream_response(model=model, messages=self.model_messages(), tools=tools, resume=resume)

    def _reattach_fallback(self, reason: str, cursor: ResponseCursor) -> None:
        """The stored generation cannot be rejoined: say why; the step becomes an ordinary continuation."""
        logger.warning("cannot reattach to %s (%s): continuing instead", cursor.response_id, reason)
        diagnostics.emit(
            "chat:reattach:fallback",
            {"requestId": self.request_id, "responseId": cursor.response_id, "reason": reason},
            agent=self.agent.agent,
            name=self.agent.name,
        )

    def _reattach_blocker(self) -> str | None:
        """Why the stored generation must not be rejoined: a tool call it was streaming when the turn
        died is in the transcript as interrupted, and rejoining would emit that call a second time."""
        last: UIMessage | dict[str, Any] = self._last_assistant() or {}
        for part in last.get("parts") or []:
            if (
                is_tool_part(part)
                and part.get("state") == "output-error"
                and part.get("errorText") == INTERRUPTED
            ):
                return "tool_call_cut_off"
        return None

    async def _stream_step(self, chunker: UIChunker) -> None:
        if self.reattach is not None:
            blocker = self._reattach_blocker()
            if blocker is not None:
                self._reattach_fallback(blocker, self.reattach)
                self.reattach = None
        resuming = self.reattach
        seam = self._seam() if resuming is None else None  # a rejoined generation has no seam
        await self._load_files()
        events = self._model_events()
        self.seam_due = False
        stall_ms = int(self.agent.chat_stream_stall_timeout_ms)
        try:
            while True:
                try:
                    async with asyncio.timeout(stall_ms / 1000 if stall_ms > 0 else None):
                        event = await events.__anext__()
                except StopAsyncIteration:
                    break
                except ReattachUnavailable as exc:
                    assert resuming is not None
                    self._reattach_fallback(f"{exc.reason}: {exc}", resuming)
                    await events.aclose()
                    resuming, events = None, self._model_events()
                    continue
                except TimeoutError:
                    diagnostics.emit(
                        "chat:stream:stalled",
                        {"requestId": self.request_id, "timeoutMs": stall_ms},
                        agent=self.agent.agent,
                        name=self.agent.name,
                    )
                    raise StreamStalled(stall_ms) from None
                if seam is not None and not seam.decided:
                    if isinstance(event, TextDelta):
                        if text := seam.feed(event.text):
                            await self._seam_repaired(seam, chunker, text)
                        continue
                    await self._seam_repaired(seam, chunker, seam.finish())  # text ended: decide now
                if isinstance(event, Marked):
                    chunks = chunker.feed(event.event) if event.event is not None else []
                    await self._emit_all(chunks, event.cursor)
                else:
                    await self._emit_all(chunker.feed(event))
            if seam is not None and not seam.decided:
                await self._seam_repaired(seam, chunker, seam.finish())
        finally:
            await events.aclose()

    def _continuation_request(self, model: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
        """A continuation's first step says how it asks the model to go on (chat:continuation:style); by
        prefill, the provider's own flags for it."""
        last = messages[-1] if messages else {}
        prefill = last.get("role") == "assistant"
        if not self.seam_due or not (prefill or last.get("content") == CONTINUE_PROMPT):
            return {}
        style = "prefill" if prefill else "instruction"
        diagnostics.emit(
            "chat:continuation:style",
            {"requestId": self.request_id, "style": style, "model": self.model},
            agent=self.agent.agent,
            name=self.agent.name,
        )
        return prefill_request(model, messages) if prefill else {}

    def _seam(self) -> Seam | None:
        """The seam of a continuation's first step: the text it continues, if the partial ends in text."""
        if not self.seam_due or not self.accumulator.has_content:
            return None
        parts = [p for p in self.accumulator.message().get("parts") or [] if p.get("type") != "step-start"]
        last = parts[-1] if parts else None
        if last is None or last.get("type") != "text" or not last.get("text"):
            return None
        return Seam(str(last["text"]))

    async def _seam_repaired(self, seam: Seam, chunker: UIChunker, text: str) -> None:
        """Send what the seam released; say once what it dropped (chat:continuation:seam)."""
        if seam.dropped:
            diagnostics.emit(
                "chat:continuation:seam",
                {"requestId": self.request_id, "droppedChars": len(seam.dropped)},
                agent=self.agent.agent,
                name=self.agent.name,
            )
            seam.dropped = ""
        if text:
            await self._emit_all(chunker.feed(TextDelta(text)))

    async def _handle_calls(self, calls: list[ToolCall]) -> bool:
        """Run the step's server tools (in parallel); True when a human must act before the next step."""
        waiting = False
        runs = []
        for call in calls:
            if call.input is None:
                continue  # a tool-input-error part already settled it
            item = self.toolset.get(call.name)
            if item is None:
                tracing.tool_not_run(call.name, call.id, "unknown_tool")
                await self.emit(ToolOutcome(error_text=UNKNOWN_TOOL.format(name=call.name)).chunk(call.id))
            elif item.is_client:
                tracing.tool_not_run(call.name, call.id, "client")
                waiting = True
            elif item.needs_approval and (problem := input_problem(item, call.input)) is not None:
                tracing.tool_not_run(call.name, call.id, "invalid_input")
                await self.emit(ToolOutcome(error_text=problem).chunk(call.id))
            elif item.needs_approval:
                tracing.tool_not_run(call.name, call.id, "approval_requested")
                approval = {
                    "type": "tool-approval-request",
                    "approvalId": str(uuid.uuid4()),
                    "toolCallId": call.id,
                }
                await self.emit(approval)
                waiting = True
            else:
                runs.append(self._run_tool(item, call.id, call.input))
        await asyncio.gather(*runs)
        return waiting

    async def _run_tool(self, item: Tool, tool_call_id: str, tool_input: Any) -> None:
        outcome = await self._execute(item, tool_call_id, tool_input)
        await self.emit(outcome.chunk(tool_call_id))

    async def _execute(self, item: Tool, tool_call_id: str, tool_input: Any) -> ToolOutcome:
        with tracing.tool_span(item.name, tool_call_id) as span:
            context = self.agent.context
            outcome = await tool_execute(
                item, tool_input, context.for_call(tool_call_id) if context else None
            )
            if outcome.failure is not None:  # a bug or an outage: recorded, and named only by its id
                outcome = await faults.tool_failed(
                    outcome,
                    name=item.name,
                    tool_call_id=tool_call_id,
                    agent=self.agent,
                    request_id=self.request_id,
                )
            tracing.tool_ended(span, outcome)
        return outcome

    async def _run_approved(self) -> None:
        """Execute the tools a human approved in the last assistant message (their results go there)."""
        last = self._last_assistant()
        if last is None:
            return
        for index, part in enumerate(list(last.get("parts") or [])):
            if not (is_tool_part(part) and part.get("state") == "approval-responded"):
                continue
            if not (part.get("approval") or {}).get("approved"):
                continue
            item = self.toolset.get(tool_name_of(part))
            problem = approved_call_problem(item, part)
            if problem is not None:
                outcome = ToolOutcome(error_text=problem)
            else:
                assert item is not None
                outcome = await self._execute(item, str(part["toolCallId"]), part.get("input"))
            chunk = outcome.chunk(str(part["toolCallId"]))
            await self.emit(chunk)  # an extended message is the accumulator's: the chunk settles it there
            if self.extends is not None:
                continue
            # The model of this turn sees the result in the earlier message.
            changes = {k: v for k, v in chunk.items() if k not in ("type", "toolCallId")}
            state = "output-error" if outcome.error_text is not None else "output-available"
            settled = result_update({**part, "state": "approval-responded"}, {"state": state, **changes})
            last["parts"][index] = settled or part
