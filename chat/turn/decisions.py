"""A decision on a tool call waiting for approval, made by code (AgentHandle.approve / deny, the admin,
`manage.py think_approve`): applied as a client's approval is, then told to every tab."""

from __future__ import annotations

from .. import broadcast
from ..transcript.interactions import InteractionResult, tool_decision_apply


def tool_decide(
    conversation_id: int, tool_call_id: str, *, approved: bool, reason: str | None = None
) -> InteractionResult:
    return tool_decision_apply(
        conversation_id=conversation_id,
        tool_call_id=tool_call_id,
        approved=approved,
        reason=reason,
        announce=broadcast.announcer(conversation_id),
    )
