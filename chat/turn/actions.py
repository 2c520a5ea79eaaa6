"""Actions on a conversation from outside its turns, each a transaction (chat.transcript) and then
the frames every tab needs: stop everything, and switch a branch.

The stop is one transaction (chat.transcript.stop); once it has committed, each client that
watched a stopped stream gets that stream's end (outcome "aborted", after its last stored chunk), each
sender of a queued turn its end, every tab a `cf_agent_chat_stopped` frame saying what was stopped and
the transcript as stored, and connections parked for a turn that will not come are released. Used by
the WebSocket consumer, `AgentHandle.stop_conversation()`, the admin action and `manage.py
stop_conversation`. A branch switch (chat.transcript.branches) sends every tab the transcript when it
changed.
"""

from __future__ import annotations

import logging

from recovery.observe import diagnostics
from recovery.process import runtime
from recovery.process.runtime import db

from .. import broadcast
from ..models import Conversation
from ..protocol import chat_stopped_frame, recovering_frame, response_frame
from ..transcript.branches import branch_switch
from ..transcript.stop import StopReport, conversation_stop

logger = logging.getLogger(__name__)

STOP_EVENT = "chat:conversation:stopped"


async def astop_conversation(conversation_id: int) -> StopReport:
    """Stop the conversation's active turn, queued turns, open submissions, waiting tool calls and open
    recovery incidents, then tell its clients (see the module docstring)."""
    report = await db(conversation_stop, conversation_id=conversation_id)
    for stream in report.streams:
        frame = response_frame(
            stream.request_id,
            done=True,
            seq=stream.seq,
            continuation=stream.continuation,
            outcome="aborted",
        )
        await broadcast.publish_stream_end(conversation_id, stream.request_id, stream.seq, frame)
    for request_id in report.queued:  # whoever sent them stops waiting
        await broadcast.publish(conversation_id, response_frame(request_id, done=True, outcome="aborted"))
    if report.recovering:
        await broadcast.publish(conversation_id, recovering_frame(False))
    await broadcast.publish(conversation_id, chat_stopped_frame(report.as_dict()))
    # After the ends, as a turn's own finish does: clients take the stored transcript as the truth.
    await broadcast.publish_transcript(conversation_id)
    await broadcast.release_parked(conversation_id)
    conversation = await db(Conversation.objects.get, pk=conversation_id)
    diagnostics.emit(STOP_EVENT, report.as_dict(), agent=conversation.agent, name=conversation.name)
    if report.stopped_anything:
        logger.info("conversation stopped: %s", report.as_dict(), extra={"conversation_id": conversation_id})
    return report


def stop_conversation(conversation_id: int) -> StopReport:
    """astop_conversation for synchronous callers (a view, the admin, a management command)."""
    return runtime.run(astop_conversation(conversation_id))


async def aswitch_branch(conversation_id: int, anchor_message_id: str, index: int) -> bool:
    """Bring back alternative `index` after `anchor_message_id`; every tab gets the transcript when it
    changed. Raises BranchNotFound, or ConversationBusy while a turn runs or recovers."""
    changed = await db(
        branch_switch, conversation_id=conversation_id, anchor_message_id=anchor_message_id, index=index
    )
    if changed:
        await broadcast.publish_transcript(conversation_id)
    return changed


def switch_branch(conversation_id: int, anchor_message_id: str, index: int) -> bool:
    """aswitch_branch for synchronous callers (on the process loop, whatever loop the caller's thread has)."""
    return runtime.run(aswitch_branch(conversation_id, anchor_message_id, index))
