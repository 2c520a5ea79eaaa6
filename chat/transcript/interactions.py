"""Client interactions: tool results and approvals applied to the transcript, and auto-continuation.

A result or approval updates the tool part it answers (in the stored message, or, when the turn that
asked for it has not stored its message yet, in a buffer that turn applies when it finishes). Once
every call of the message's batch is answered and any answer asked for it, a continuation turn starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from ..models import Conversation, Message
from ..protocol import ToolApproval, ToolResult
from ..types import Part, UIMessage
from .answer_buffer import already_buffered, buffer_refusal, buffered_copy, turn_in_flight
from .quotas import principal_refusal, principal_turn_counted
from .repair import batch_complete, is_settled
from .turns import turn_start_followup

logger = logging.getLogger(__name__)

DENIED_TEXT = "Tool execution denied by user"


@dataclass(frozen=True)
class InteractionResult:
    # "applied", "buffered", "noop" (already answered), "refused" (a result for a server tool's call:
    # not the client's to answer; or an answer over a bound, chat.transcript.answer_buffer) or "unknown"
    # (no such tool call)
    status: str
    message: UIMessage | None = None  # the updated message, for cf_agent_message_updated
    continuation_request_id: str | None = None
    refused: str = ""  # why the continuation the answer completes did not start (a principal's limit)
    problem: str = ""  # why the answer itself was refused (status "refused"): cf_agent_tool_refused


def tool_part_name(part: Part) -> str:
    """The tool a tool part calls: `tool-<name>`, or a dynamic tool's `toolName`."""
    kind = str(part.get("type", ""))
    return str(part.get("toolName", "")) if kind == "dynamic-tool" else kind.removeprefix("tool-")


def server_tool_call(part: Part, update: dict[str, Any]) -> bool:
    """Whether a result answers a call of a server tool (`update["serverTools"]`: the agent's, when the
    answer arrived), one waiting for approval, which only server tools ask for, or a `dynamic-tool` call,
    which only the worker makes (an MCP server's tool, chat.turn.mcp). Its output is written by the
    worker that runs it, never by a client: not while it runs, not instead of the approval (approving
    runs it), not after an interruption left it unanswered."""
    if part.get("state") in ("approval-requested", "approval-responded"):
        return True
    if part.get("type") == "dynamic-tool":
        return True
    return tool_part_name(part) in update.get("serverTools", ())


def result_update(part: Part, update: dict[str, Any]) -> Part | None:
    """The part answered by a client tool result; None when it is not waiting for one."""
    if part.get("state") != "input-available":
        return None
    if update.get("state") == "output-error":
        return {**part, "state": "output-error", "errorText": update.get("errorText") or DENIED_TEXT}
    return {**part, "state": "output-available", "output": update.get("output"), "preliminary": False}


def approval_update(part: Part, update: dict[str, Any]) -> Part | None:
    """The part after a human's decision; None when it is not waiting for one (only a call that asked
    for an approval waits for one: a decision for any other call would make the worker run it)."""
    if part.get("state") != "approval-requested":
        return None
    approved = bool(update.get("approved"))
    approval = {**(part.get("approval") or {}), "approved": approved}
    approval.setdefault("id", part.get("toolCallId"))
    if update.get("reason"):
        approval["reason"] = str(update["reason"])
    return {**part, "state": "approval-responded" if approved else "output-denied", "approval": approval}


def decision_problem(part: Part, update: dict[str, Any]) -> str | None:
    """Why a decision from code (`update["strict"]`) cannot apply to `part`; None when it can, or when
    the same decision was made already (nothing to do)."""
    state, approved = part.get("state"), bool(update.get("approved"))
    decided = (part.get("approval") or {}).get("approved")
    if state == "approval-requested":
        return None
    if decided is not None and bool(decided) == approved:
        return None  # made already, maybe run already: the same answer again changes nothing
    if decided is not None:
        return f"tool call {update['toolCallId']!r} was {'approved' if decided else 'denied'} already"
    return f"tool call {update['toolCallId']!r} is not waiting for an approval (it is {state})"


UPDATERS: dict[str, Callable[[Part, dict[str, Any]], Part | None]] = {
    "result": result_update,
    "approval": approval_update,
}


def _find(conversation_id: int, tool_call_id: str) -> tuple[Message, int] | None:
    candidates = Message.objects.filter(
        conversation_id=conversation_id,
        role=Message.Role.ASSISTANT,
        parts__contains=[{"toolCallId": tool_call_id}],
    ).order_by("-position")
    for message in candidates[:1]:
        for index, part in enumerate(message.parts):
            if part.get("toolCallId") == tool_call_id:
                return message, index
    return None


SERVER_TOOL_PROBLEM = "tool call {!r} is a server tool's: the server writes its output"


def _apply(conversation: Conversation, update: dict[str, Any]) -> tuple[str, Message | None]:
    found = _find(conversation.pk, update["toolCallId"])
    if found is None:
        return "unknown", None
    message, index = found
    if update["kind"] == "result" and server_tool_call(message.parts[index], update):
        logger.warning("a client's result for server tool call %s refused", update["toolCallId"])
        return "refused", None
    if update.get("strict") and decision_problem(message.parts[index], update) is not None:
        return "refused", message
    new_part = UPDATERS[update["kind"]](message.parts[index], update)
    if new_part is None:
        return "noop", message
    message.parts = [*message.parts[:index], new_part, *message.parts[index + 1 :]]
    message.save(update_fields=["parts", "updated_at"])
    if update.get("autoContinue"):
        conversation.continue_armed = message.message_id
    return "applied", message


def _buffered_decision_problem(conversation: Conversation, update: dict[str, Any]) -> str:
    """A decision from code for a call whose other answer already waits for its turn: refused."""
    if not update.get("strict"):
        return ""
    for waiting in conversation.tool_updates:
        if waiting.get("toolCallId") == update["toolCallId"] and waiting.get("kind") == update["kind"]:
            if bool(waiting.get("approved")) != bool(update.get("approved")):
                decided = "approved" if waiting.get("approved") else "denied"
                return f"tool call {update['toolCallId']!r} was {decided} already"
    return ""


def continuation_due(conversation: Conversation, message: Message) -> bool:
    """The armed batch of `message` is complete and the message is still the leaf."""
    if conversation.continue_armed != message.message_id:
        return False
    if not batch_complete(message.as_ui_message()):
        return False
    leaf = Message.objects.filter(conversation=conversation).order_by("-position").first()
    return leaf is not None and leaf.pk == message.pk


Announce = Callable[[UIMessage], None]


def interaction_apply(
    *,
    conversation_id: int,
    update: dict[str, Any],
    owner: str | None = None,
    announce: Announce | None = None,
    address: str | None = None,
) -> InteractionResult:
    """Apply one result or approval (`update["kind"]`); buffered while its turn is still finishing.

    `owner`, the connection that answered, owns the continuation it starts, if the conversation's
    principal (answering from `address`) is within its limits (chat.transcript.quotas). `announce` gets the
    updated message once the change is committed and before the continuation is sent to a worker:
    every client hears of the update before the first frame of the continuation, so a late copy of
    the stored message cannot overwrite the continuation's text on a screen.
    """

    with transaction.atomic():
        conversation = Conversation.objects.select_for_update().get(pk=conversation_id)
        status, message = _apply(conversation, update)
        if status == "refused" and message is not None:  # a decision from code, for a call not waiting
            part = next(p for p in message.parts if p.get("toolCallId") == update["toolCallId"])
            return InteractionResult(status, problem=decision_problem(part, update) or "")
        if status == "refused":
            return InteractionResult(status, problem=SERVER_TOOL_PROBLEM.format(update["toolCallId"]))
        if status == "unknown" and turn_in_flight(conversation):
            if already_buffered(conversation, update):
                problem = _buffered_decision_problem(conversation, update)
                return InteractionResult("refused", problem=problem) if problem else InteractionResult("noop")
            problem = buffer_refusal(conversation, update)
            if problem:
                logger.warning("answer for tool call %s refused: %s", update["toolCallId"], problem)
                return InteractionResult("refused", problem=problem)
            conversation.tool_updates = [*conversation.tool_updates, buffered_copy(update)]
            status = "buffered"
        if update.get("clientTools") is not None and status != "unknown":  # not a made-up call's
            conversation.last_client_tools = update["clientTools"]
        if status == "applied" and message is not None and announce is not None:
            stored = message.as_ui_message()  # on_commit hooks run in order: this one first
            transaction.on_commit(lambda: announce(stored), robust=True)
        continuation, refused = None, ""
        if status == "applied" and message is not None and continuation_due(conversation, message):
            conversation.continue_armed = ""
            refused = principal_refusal(conversation.owner, address=address)
            if not refused:
                followup = turn_start_followup(
                    conversation=conversation, require_idle=False, owner_channel=owner or None
                )
                continuation = followup.request_id
                principal_turn_counted(conversation.owner)
        conversation.save(update_fields=["last_client_tools", "tool_updates", "continue_armed", "updated_at"])
    ui_message = message.as_ui_message() if status == "applied" and message is not None else None
    return InteractionResult(status, ui_message, continuation, refused)


def tool_result_apply(
    *,
    conversation_id: int,
    result: ToolResult,
    server_tools: Collection[str],
    owner: str | None = None,
    announce: Announce | None = None,
    address: str | None = None,
) -> InteractionResult:
    """A client's tool result; `server_tools` are the agent's (results for their calls are refused)."""
    return interaction_apply(
        conversation_id=conversation_id,
        owner=owner,
        announce=announce,
        address=address,
        update={
            "kind": "result",
            "serverTools": sorted(server_tools),
            "toolCallId": result.tool_call_id,
            "output": result.output,
            "state": result.state,
            "errorText": result.error_text,
            "autoContinue": result.auto_continue,
            "clientTools": result.client_tools,
        },
    )


def tool_approval_apply(
    *,
    conversation_id: int,
    approval: ToolApproval,
    owner: str | None = None,
    announce: Announce | None = None,
    address: str | None = None,
) -> InteractionResult:
    return interaction_apply(
        conversation_id=conversation_id,
        owner=owner,
        announce=announce,
        address=address,
        update={
            "kind": "approval",
            "toolCallId": approval.tool_call_id,
            "approved": approval.approved,
            "autoContinue": approval.auto_continue,
        },
    )


def tool_decision_apply(
    *,
    conversation_id: int,
    tool_call_id: str,
    approved: bool,
    reason: str | None = None,
    announce: Announce | None = None,
) -> InteractionResult:
    """A decision from code (`AgentHandle.approve` / `deny`, the admin, `manage.py think_approve`): the
    wire's approval, made strict. It applies only to a call waiting for approval (or already decided
    the same way: "noop"); another call is "refused" with the problem, an unknown one is "unknown".
    The continuation it completes belongs to no connection and is within no principal's limit but the
    conversation owner's, as an approval from the owner's socket would be."""
    return interaction_apply(
        conversation_id=conversation_id,
        announce=announce,
        update={
            "kind": "approval",
            "strict": True,
            "toolCallId": tool_call_id,
            "approved": approved,
            "reason": reason,
            "autoContinue": True,
        },
    )


def buffered_updates_apply(conversation: Conversation) -> list[UIMessage]:
    """Apply what arrived while the finishing turn ran (call with the conversation locked)."""
    messages: dict[str, UIMessage] = {}
    for update in conversation.tool_updates:
        status, message = _apply(conversation, update)
        if status == "unknown":
            logger.info("tool update for unknown call %s dropped", update.get("toolCallId"))
        elif status == "applied" and message is not None:
            messages[message.message_id] = message.as_ui_message()
    conversation.tool_updates = []
    return list(messages.values())


def foreign_updates_apply(*, conversation_id: int, updates: list[dict[str, Any]]) -> None:
    """Tool outputs a continuation produced for calls of an earlier message; the first write wins."""
    for update in updates:
        found = _find(conversation_id, str(update.get("toolCallId")))
        if found is None:
            continue
        message, index = found
        part = message.parts[index]
        if is_settled(part):
            continue
        changes = {k: v for k, v in update.items() if k != "toolCallId"}
        message.parts = [*message.parts[:index], {**part, **changes}, *message.parts[index + 1 :]]
        message.save(update_fields=["parts", "updated_at"])
