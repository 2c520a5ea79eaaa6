"""Fan-out to the clients of a conversation through the channel layer (one group per conversation).

Frames are encoded once by the producer; consumers forward the text and filter by sequence number,
so the per-chunk path does no JSON work in the web processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from redis.exceptions import RedisError

from recovery.lease.fibers import conversation_busy
from recovery.process.runtime import db

from .conf import think_setting
from .protocol import message_updated_frame, response_frame
from .transcript.window import transcript_frame
from .types import UIMessage

logger = logging.getLogger(__name__)

# Group event types, dispatched to the consumer methods of the same name (dots become underscores).
FRAMES = "think.frames"
STREAM_STARTED = "think.stream_started"
STREAM_END = "think.stream_end"
BROADCAST = "think.broadcast"
RELEASE_PARKED = "think.release_parked"


def group_name(conversation_id: int) -> str:
    return f"{think_setting('GROUP_PREFIX')}.conv.{conversation_id}"


async def group_send(conversation_id: int, event: dict[str, Any]) -> None:
    """Send a group event; a channel layer that is down is logged, never raised.

    Everything an event carries is in Postgres before it is sent (frames, transcripts, a stream's
    end), and a Redis outage also ends every consumer's socket: its clients reconnect and read it
    there. So a turn must not fail, nor stop streaming into Postgres, because the layer did.
    """
    layer = get_channel_layer()
    if layer is None:
        raise RuntimeError("CHANNEL_LAYERS is not configured")
    try:
        await layer.group_send(group_name(conversation_id), event)
    except (RedisError, OSError) as exc:
        logger.warning(
            "channel layer send failed: %s",
            exc,
            extra={"conversation_id": conversation_id, "group_event": event.get("type")},
        )


async def publish_frames(conversation_id: int, request_id: str, frames: list[tuple[int, str]]) -> None:
    await group_send(conversation_id, {"type": FRAMES, "request_id": request_id, "frames": frames})


async def publish_frames_many(batches: list[tuple[tuple[int, str], list[tuple[int, str]]]]) -> None:
    """The frames of a flusher tick, every turn's, in one round trip when the channel layer can
    (`chat.wire.layers.RedisFanoutLayer.group_send_many`); one group_send each otherwise."""
    layer = get_channel_layer()
    if layer is None:
        raise RuntimeError("CHANNEL_LAYERS is not configured")
    sends = [
        (group_name(conversation_id), {"type": FRAMES, "request_id": request_id, "frames": frames})
        for (conversation_id, request_id), frames in batches
    ]
    many = getattr(layer, "group_send_many", None)
    try:
        if many is not None:
            await many(sends)
            return
        for group, event in sends:
            await layer.group_send(group, event)
    except (RedisError, OSError) as exc:  # as in group_send: the frames are in Postgres already
        logger.warning(
            "channel layer send failed: %s", exc, extra={"group_event": FRAMES, "groups": len(sends)}
        )


async def publish_stream_started(conversation_id: int, request_id: str) -> None:
    await group_send(conversation_id, {"type": STREAM_STARTED, "request_id": request_id})


async def publish_stream_end(conversation_id: int, request_id: str, seq: int, frame: str) -> None:
    """The done frame of a stream: it has a seq too, so it is delivered once and after every chunk."""
    event = {"type": STREAM_END, "request_id": request_id, "seq": seq, "frame": frame}
    await group_send(conversation_id, event)


async def publish(conversation_id: int, frame: str, *, exclude: list[str] | None = None) -> None:
    """Send one encoded frame to every connection of the conversation except the excluded channels."""
    await group_send(conversation_id, {"type": BROADCAST, "frame": frame, "exclude": exclude or []})


async def publish_transcript(conversation_id: int) -> None:
    """Every client of the conversation gets the stored transcript, which clients take as the truth:
    after a change no stream of theirs carried (a turn's end, a repair, a compaction, a branch switch,
    a stop, a recovery's end)."""
    await publish(conversation_id, await db(transcript_frame, conversation_id=conversation_id))


def accept_announcer(
    conversation_id: int, *, exclude: list[str] | None = None
) -> Callable[[tuple[str, ...]], None]:
    """What an accepted turn announces itself with (`turn_accept(announce=...)`), run on commit in the
    database thread, before the turn is sent to a worker: the senders of the turns it replaced stop
    waiting, and every client of the conversation but `exclude` gets the transcript with the new
    messages. Published after the send, a short answer could stream and end first, and this older copy
    would then wipe it from the other tabs' screens (as `announcer` says of a tool answer). The
    transcript is read only when someone may hear it: most conversations have one socket, the sender's
    (a read per accept, issue 37)."""

    def announce(superseded: tuple[str, ...]) -> None:
        for request_id in superseded:
            publish_sync(conversation_id, response_frame(request_id, done=True, outcome="skipped"))
        if async_to_sync(_heard_by_others)(conversation_id, exclude or []):
            frame = transcript_frame(conversation_id=conversation_id)
            publish_sync(conversation_id, frame, exclude=exclude)

    return announce


async def _heard_by_others(conversation_id: int, exclude: list[str]) -> bool:
    """Whether a connection of the conversation but `exclude` may hear a group message now (True when
    the channel layer cannot tell, or cannot be asked)."""
    others = getattr(get_channel_layer(), "group_has_others", None)
    if others is None:
        return True
    try:
        return bool(await others(group_name(conversation_id), exclude))
    except (RedisError, OSError):
        return True


def announcer(conversation_id: int) -> Callable[[UIMessage], None]:
    """What a client's tool answer announces its updated message with: every client of the
    conversation, the sender too, replaces the message by id. Run on commit, in the database thread,
    before the continuation the answer completes is sent to a worker: published after it, a slow web
    process could deliver this stored copy after the continuation had streamed into the message, and
    the copy would wipe it from the screen."""

    def announce(message: UIMessage) -> None:
        publish_sync(conversation_id, message_updated_frame(message))

    return announce


def publish_sync(conversation_id: int, frame: str, *, exclude: list[str] | None = None) -> None:
    async_to_sync(publish)(conversation_id, frame, exclude=exclude)


async def release_parked(conversation_id: int) -> None:
    await group_send(conversation_id, {"type": RELEASE_PARKED})


async def release_parked_if_idle(conversation_id: int) -> None:
    """Release parked connections when no turn is queued or running (none will start a stream)."""

    if not await db(conversation_busy, conversation_id):
        await release_parked(conversation_id)
