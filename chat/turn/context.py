"""RunContext: what a running turn knows of itself, for its tools and its agent's hooks.

A tool asks for it with a first parameter annotated `RunContext` (kept out of the tool's schema); an
agent reads it as `self.context` while one of its turns runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chat.models import Conversation

    from .agent import Think


@dataclass(frozen=True)
class RunContext:
    """The running turn: whose conversation it is and which run of the turn this is."""

    agent: Think  # the agent instance running the turn (its `name`, `stash()`, `handle`, ...)
    conversation: Conversation  # the row, as the turn found it when it started
    owner: str  # the conversation's owner principal ("user:<pk>", "session:<hash>", ...); "" for none
    user: Any  # the owner's Django user when the owner is a user (and still exists), else None
    request_id: str  # the turn's request id (a recovery's continuation has its own)
    attempt: int  # 0 for the turn's first run; n for the n-th recovery attempt that continues it
    tool_call_id: str | None = None  # the call a tool is answering (None in hooks)

    @property
    def recovering(self) -> bool:
        """Whether this run continues a turn a failure interrupted."""
        return self.attempt > 0

    def for_call(self, tool_call_id: str) -> RunContext:
        return replace(self, tool_call_id=tool_call_id)


def run_context_load(
    *, agent: Think, conversation_id: int, request_id: str, incident_id: str | None
) -> RunContext:
    """The context of a turn about to run (sync: the ORM)."""
    from django.contrib.auth import get_user_model

    from chat.models import Conversation
    from recovery.models import Incident

    conversation = Conversation.objects.get(pk=conversation_id)
    user = None
    kind, _, key = conversation.owner.partition(":")
    if kind == "user" and key:
        model = get_user_model()
        try:
            user = model._default_manager.filter(pk=model._meta.pk.to_python(key)).first()
        except Exception:  # a key the user model's primary key cannot hold: no such user
            user = None
    attempt = 0
    if incident_id:
        found = Incident.objects.filter(conversation_id=conversation_id, incident_id=incident_id)
        attempt = found.values_list("attempt", flat=True).first() or 1
    return RunContext(
        agent=agent,
        conversation=conversation,
        owner=conversation.owner,
        user=user,
        request_id=request_id,
        attempt=attempt,
    )
