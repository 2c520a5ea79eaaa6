"""The channel layer the chat apps want: channels_redis's pub/sub layer, plus a batched group send.

`RedisPubSubChannelLayer` delivers a group message with one `PUBLISH` (no per-consumer queues in
Redis, no polling: each web process holds one subscription connection and hands messages to its
consumers); `group_send_many` sends many groups' messages in one pipelined round trip, which is what
the worker's flusher does with every turn's frames of a tick (`chat.broadcast.publish_frames_many`);
`group_has_others` tells whether anyone but the sender would hear a message, so that the web process
reads a transcript for other tabs only when there are some (`chat.broadcast.accept_announcer`);
`channel_is_open` whether a given connection is still open anywhere (`chat.wire.presence`).

A message published while a web process is not subscribed (a Redis restart, a reconnect) is lost, as
with any pub/sub; every frame carries its `seq`, and a consumer fills a gap, or a silence, from
Postgres (`chat.wire.consumers`), so nothing a client must see depends on the layer delivering it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from channels_redis.pubsub import RedisPubSubChannelLayer


class RedisFanoutLayer(RedisPubSubChannelLayer):
    async def group_send_many(self, sends: list[tuple[str, dict[str, Any]]]) -> None:
        """Send each (group, message) pair, all of them in one round trip per Redis shard."""
        layer = self._get_layer()
        by_shard: dict[Any, list[tuple[str, bytes]]] = {}
        for group, message in sends:
            channel = layer._get_group_channel_name(group)
            by_shard.setdefault(layer._get_shard(channel), []).append((channel, self.serialize(message)))
        for shard, items in by_shard.items():
            async with shard._lock:
                shard._ensure_redis()
                pipeline = shard._redis.pipeline(transaction=False)
                for channel, data in items:
                    pipeline.publish(channel, data)
                await pipeline.execute()

    async def group_has_others(self, group: str, exclude: Collection[str]) -> bool:
        """Whether a connection of `group` other than `exclude` hears a message sent to it now: one of
        this process's, or any other process subscribed to the group (one PUBSUB NUMSUB, asked only
        when this process has none but the excluded)."""
        layer = self._get_layer()
        channel = layer._get_group_channel_name(group)
        here = layer.groups.get(channel, set())
        if here - set(exclude):
            return True
        return await _subscribers(layer, channel) > (1 if here else 0)  # this process is one while it has any

    async def channel_is_open(self, channel: str) -> bool:
        """Whether the consumer of `channel` (its channel name) runs now, in this process or another: its
        channel is subscribed while it does, and not a moment after its process dies (one PUBSUB NUMSUB,
        asked only when it is not this process's)."""
        layer = self._get_layer()
        return channel in layer.channels or await _subscribers(layer, channel) > 0


async def _subscribers(layer: Any, channel: str) -> int:
    """How many connections to Redis subscribe to `channel`, on its shard."""
    shard = layer._get_shard(channel)
    async with shard._lock:
        shard._ensure_redis()
        [(_, subscribers)] = await shard._redis.pubsub_numsub(channel)
    return int(subscribers)
