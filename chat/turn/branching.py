"""Switching branches, and telling every tab (chat.transcript.branches holds the branches)."""

from __future__ import annotations

from recovery import runtime
from recovery.runtime import db

from ..transcript.branches import branch_switch
from ..transcript.window import transcript_frame
from ..wire import broadcast


async def aswitch_branch(conversation_id: int, anchor_message_id: str, index: int) -> bool:
    """Bring back alternative `index` after `anchor_message_id`; every tab gets the transcript when it
    changed. Raises BranchNotFound, or ConversationBusy while a turn runs or recovers."""
    changed = await db(
        branch_switch, conversation_id=conversation_id, anchor_message_id=anchor_message_id, index=index
    )
    if changed:
        await broadcast.publish(conversation_id, await db(transcript_frame, conversation_id=conversation_id))
    return changed


def switch_branch(conversation_id: int, anchor_message_id: str, index: int) -> bool:
    """aswitch_branch for synchronous callers (on the process loop, whatever loop the caller's thread has)."""
    return runtime.run(aswitch_branch(conversation_id, anchor_message_id, index))
