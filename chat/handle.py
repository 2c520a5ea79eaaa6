"""A conversation for code outside its turns: the handle `open_agent()` returns, and the programmatic
turns behind it (`save_messages`, `continue_last_turn`, `chat()`, waiting for a turn's outcome).

Each starts a turn inside a fiber, exactly like a WebSocket turn, so a crash or a deploy is recovered
the same way. A turn's outcome follows its recovery chain: a turn that was interrupted and continued
ends with the outcome of the continuation that finished it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from recovery.lease.fibers import conversation_busy
from recovery.models import Fiber
from recovery.process import runtime
from recovery.process.runtime import db

from .exceptions import ToolCallNotWaiting
from .models import Conversation, Submission
from .transcript.selectors import chain_outcome, interaction_pending, messages_list
from .transcript.snapshot import TurnKind
from .transcript.submissions import submission_cancel, submission_create, submission_delete, submission_get
from .transcript.turns import (
    POLL_S,
    MessagesOrFunction,
    TurnResult,
    await_stable,
    turn_start_programmatic,
    turn_start_recovered,
    wait_until_stable,
)
from .types import UIMessage

if TYPE_CHECKING:
    from .transcript.stop import StopReport
    from .transcript.submissions import SubmitResult
    from .turn.agent import ChunkCallback, Think


def turn_wait(*, conversation_id: int, request_id: str, timeout: float | None = None) -> TurnResult:
    """Block until the turn (and any recovery of it) has an outcome; raises TimeoutError."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        outcome = chain_outcome(conversation_id=conversation_id, root_request_id=request_id)
        if outcome is not None:
            return TurnResult(request_id, outcome)
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"turn {request_id} still running after {timeout}s")
        time.sleep(POLL_S)


async def aturn_wait(*, conversation_id: int, request_id: str, timeout: float | None = None) -> TurnResult:
    """turn_wait for async callers: polls without holding a thread."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        outcome = await db(chain_outcome, conversation_id=conversation_id, root_request_id=request_id)
        if outcome is not None:
            return TurnResult(request_id, outcome)
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"turn {request_id} still running after {timeout}s")
        await asyncio.sleep(POLL_S)


@dataclass(frozen=True)
class ChatResult:
    """The outcome of `AgentHandle.chat()`: the turn's status and the assistant message it produced."""

    request_id: str
    status: str
    message: UIMessage | None

    @property
    def text(self) -> str:
        message: UIMessage | dict[str, Any] = self.message or {}
        parts = message.get("parts") or []
        return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


async def chat_run(
    handle: AgentHandle, messages: Any, *, on_chunk: ChunkCallback | None, timeout: float | None
) -> ChatResult:
    """Run a programmatic turn on this event loop; recovery takes over if this process dies."""

    from .turn.runner import turn_run

    conversation_id = handle.conversation_id
    started = await db(
        turn_start_programmatic,
        conversation_id=conversation_id,
        messages=messages,
        timeout=timeout,
        enqueue=False,
    )
    fiber = await Fiber.objects.aget(conversation_id=conversation_id, request_id=started.request_id)
    runner = await turn_run(str(fiber.pk), on_chunk=on_chunk)
    if runner is not None and runner.outcome != "interrupted":
        message = runner.accumulator.message() if runner.accumulator.has_content else None
        return ChatResult(started.request_id, runner.outcome, message)
    # Taken by a worker, or handed to recovery (a stall): the outcome is the recovery chain's.
    result = await db(
        turn_wait, conversation_id=conversation_id, request_id=started.request_id, timeout=timeout
    )
    transcript = await db(messages_list, conversation_id=conversation_id)
    last = transcript[-1] if transcript and transcript[-1]["role"] == "assistant" else None
    return ChatResult(started.request_id, result.status, last)


MAX_DENIAL_REASON = 1000  # characters: the reason is stored with the call and read by the model
MAX_TOOL_CALL_ID = 255


@dataclass(frozen=True)
class ToolDecision:
    """What an approval or a denial from code did."""

    status: str  # "applied"; "buffered" (the turn that asked was still storing it); "noop" (made already)
    continuation_request_id: str | None = None  # the turn it started, once every call had its answer
    refused: str = ""  # why that turn did not start: the owner's limit (the decision is stored)


class AgentHandle:
    """One conversation of an agent, for code outside its turns: what `open_agent()` returns.

    It reads the transcript, waits for the conversation to settle and starts turns (`save_messages`,
    `continue_last_turn`, `chat()`, durable submissions). Every turn it starts runs inside a fiber,
    exactly like a WebSocket turn, so a crash is recovered the same way.
    """

    def __init__(self, agent: Think) -> None:
        if agent.conversation_id is None:
            raise ValueError(f"{type(agent).__name__} is not bound to a conversation")
        self.agent = agent
        self.conversation_id: int = agent.conversation_id

    @property
    def name(self) -> str:
        return self.agent.name

    def __repr__(self) -> str:
        return f"<AgentHandle {self.agent.agent}/{self.agent.name}>"

    # -- the transcript and its state -------------------------------------------------------------------
    def messages(self) -> list[UIMessage]:
        """The stored transcript, as UIMessages."""

        return messages_list(conversation_id=self.conversation_id)

    def has_pending_interaction(self, extra: list[UIMessage] | None = None) -> bool:
        """True while a human must act: an approval is requested or a client tool awaits its result.

        `extra` adds messages not stored yet (the partial of an interrupted turn).
        """
        return interaction_pending(conversation_id=self.conversation_id, extra=extra)

    def is_idle(self) -> bool:
        """No turn of this conversation is queued or running."""
        return not conversation_busy(self.conversation_id)

    def wait_until_stable(self, timeout: float | None = None) -> bool:
        """Wait until no turn runs and no human is pending; False when `timeout` seconds pass first."""
        return wait_until_stable(conversation_id=self.conversation_id, timeout=timeout)

    async def await_stable(self, timeout: float | None = None) -> bool:
        """wait_until_stable for async callers."""
        return await await_stable(conversation_id=self.conversation_id, timeout=timeout)

    # -- turns ------------------------------------------------------------------------------------------
    def save_messages(
        self, messages: MessagesOrFunction, *, wait: bool = True, timeout: float | None = None
    ) -> TurnResult:
        """Append messages (a list, or a function of the current transcript) and run a turn.

        Waits for a running turn to finish first. With `wait`, returns the outcome (`completed`, `error`,
        `aborted`), following any recovery of the turn; otherwise `accepted` at once.
        """
        started = turn_start_programmatic(
            conversation_id=self.conversation_id, messages=messages, timeout=timeout
        )
        if not wait:
            return started
        return turn_wait(conversation_id=self.conversation_id, request_id=started.request_id, timeout=timeout)

    async def asave_messages(
        self, messages: MessagesOrFunction, *, wait: bool = True, timeout: float | None = None
    ) -> TurnResult:
        """save_messages() for async callers (an async view, a ninja endpoint)."""
        started = await db(
            turn_start_programmatic, conversation_id=self.conversation_id, messages=messages, timeout=timeout
        )
        if not wait:
            return started
        return await aturn_wait(
            conversation_id=self.conversation_id, request_id=started.request_id, timeout=timeout
        )

    async def amessages(self) -> list[UIMessage]:
        return await db(self.messages)

    def continue_last_turn(
        self, body: dict[str, Any] | None = None, *, wait: bool = False, timeout: float | None = None
    ) -> TurnResult:
        """Continue the last assistant message in a new turn that extends it.

        Skipped (request id "") unless the last message is an assistant message.
        """

        started = turn_start_recovered(
            conversation_id=self.conversation_id,
            kind=TurnKind.CONTINUE,
            root_request_id="",
            incident_id=None,
            last_body=body,
        )
        if started.status == "skipped":
            return TurnResult("", "skipped")
        if not wait:
            return TurnResult(started.request_id, "accepted")
        return turn_wait(conversation_id=self.conversation_id, request_id=started.request_id, timeout=timeout)

    async def achat(
        self, messages: Any, *, on_chunk: ChunkCallback | None = None, timeout: float | None = None
    ) -> ChatResult:
        """Run a turn in this process, streaming each UI chunk to `on_chunk` (sync or async).

        The turn is durable like any other: if this process dies, recovery finishes it on a worker.
        """
        return await chat_run(self, messages, on_chunk=on_chunk, timeout=timeout)

    def chat(
        self, messages: Any, *, on_chunk: ChunkCallback | None = None, timeout: float | None = None
    ) -> ChatResult:
        """achat() for synchronous callers (a view, a management command, a Celery task)."""

        return runtime.run(self.achat(messages, on_chunk=on_chunk, timeout=timeout))

    def stop_conversation(self) -> StopReport:
        """Stop everything of this conversation in one transaction: the running turn (its partial kept,
        settled), queued turns, open submissions, approvals and client tool calls still waiting
        (settled as cancelled) and open recovery incidents; every tab is told. The next message runs
        as new work."""
        from .turn.actions import stop_conversation

        return stop_conversation(self.conversation_id)

    async def astop_conversation(self) -> StopReport:
        """stop_conversation() for async callers."""
        from .turn.actions import astop_conversation

        return await astop_conversation(self.conversation_id)

    def switch_branch(self, anchor_message_id: str, index: int) -> bool:
        """Bring back alternative `index` (0-based, oldest first) of what follows message
        `anchor_message_id` ("" for the start): a regenerated answer, or what followed a user message
        before an edit (chat.transcript.branches). False when it was already in use; every tab gets the
        transcript. Raises BranchNotFound, or ConversationBusy while a turn runs or recovers."""
        from .turn.actions import switch_branch

        return switch_branch(self.conversation_id, anchor_message_id, index)

    # -- approvals from code -----------------------------------------------------------------------------
    def waiting_approvals(self) -> list[dict[str, Any]]:
        """The tool calls of the stored transcript that wait for a human's approval, oldest first:
        `{"toolCallId", "tool", "input", "messageId"}` each."""
        from .transcript.folding import is_tool_part, tool_name_of

        return [
            {
                "toolCallId": part.get("toolCallId"),
                "tool": tool_name_of(part),
                "input": part.get("input"),
                "messageId": message["id"],
            }
            for message in self.messages()
            if message["role"] == "assistant"
            for part in message.get("parts") or []
            if is_tool_part(part) and part.get("state") == "approval-requested"
        ]

    def approve(self, tool_call_id: str) -> ToolDecision:
        """Approve a server tool's call that waits for approval, as a client's approval would: the
        tool runs in the continuation this starts (once every call of its step has an answer), with no
        socket open. Idempotent; raises ToolCallNotWaiting for a call that does not wait for approval
        (unknown, a call that asks for none, or denied already)."""
        return self._decide(tool_call_id, approved=True)

    def deny(self, tool_call_id: str, reason: str | None = None) -> ToolDecision:
        """Deny a call that waits for approval: the model is told (with `reason`, if any) and goes on."""
        return self._decide(tool_call_id, approved=False, reason=reason)

    async def aapprove(self, tool_call_id: str) -> ToolDecision:
        return await db(self.approve, tool_call_id)

    async def adeny(self, tool_call_id: str, reason: str | None = None) -> ToolDecision:
        return await db(self.deny, tool_call_id, reason)

    def _decide(self, tool_call_id: str, *, approved: bool, reason: str | None = None) -> ToolDecision:
        from .turn.decisions import tool_decide

        if not isinstance(tool_call_id, str) or not 0 < len(tool_call_id) <= MAX_TOOL_CALL_ID:
            raise ToolCallNotWaiting(f"a tool call id is a string of 1 to {MAX_TOOL_CALL_ID} characters")
        if reason is not None:
            if not isinstance(reason, str) or len(reason) > MAX_DENIAL_REASON:
                raise ValueError(f"a denial's reason is a string of at most {MAX_DENIAL_REASON} characters")
            if any(ord(c) < 32 and c not in "\n\t" or ord(c) == 127 for c in reason):
                raise ValueError("a denial's reason holds no control characters but newlines and tabs")
        result = tool_decide(self.conversation_id, tool_call_id, approved=approved, reason=reason)
        if result.status == "unknown":
            raise ToolCallNotWaiting(f"no tool call {tool_call_id!r} in {self.agent.agent}/{self.name}")
        if result.status == "refused":
            raise ToolCallNotWaiting(result.problem)
        return ToolDecision(result.status, result.continuation_request_id, result.refused)

    # -- durable submissions ----------------------------------------------------------------------------
    def submit_messages(
        self,
        messages: Any,
        *,
        submission_id: str | None = None,
        idempotency_key: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> SubmitResult:
        """Accept messages durably and run them as a turn when the conversation is free (idempotent)."""

        return submission_create(
            conversation_id=self.conversation_id,
            messages=messages,
            submission_id=submission_id,
            idempotency_key=idempotency_key,
            metadata=metadata,
        )

    async def asubmit_messages(self, messages: Any, **options: Any) -> SubmitResult:
        """submit_messages() for async callers (the same keyword arguments)."""
        return await db(self.submit_messages, messages, **options)

    def cancel_submission(self, submission_id: str) -> bool:
        """Abort a pending or running submission; False when it had already ended."""

        return submission_cancel(conversation_id=self.conversation_id, submission_id=submission_id)

    def get_submission(self, submission_id: str) -> Submission:

        return submission_get(conversation_id=self.conversation_id, submission_id=submission_id)

    def list_submissions(self) -> list[Submission]:
        return list(Submission.objects.filter(conversation_id=self.conversation_id))

    def delete_submission(self, submission_id: str) -> bool:
        """Delete a finished submission (open ones are kept: False)."""

        return submission_delete(conversation_id=self.conversation_id, submission_id=submission_id)


def conversation_handle(conversation_id: int) -> AgentHandle:
    """The handle of a stored conversation, by its id (operators' tools: the admin, commands)."""
    from .turn.registry import agent_for

    conversation = Conversation.objects.only("agent", "name").get(pk=conversation_id)
    return AgentHandle(agent_for(conversation.agent, conversation.name, conversation.pk))
