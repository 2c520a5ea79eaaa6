"""Whether a WebSocket connection is still open, in any web process.

Only used to tell whether the connection that owns a tool continuation is still there (while it is,
another connection's probe hears `continuation-owned`: docs/protocol.md). The channel layer knows: a
consumer's channel is subscribed while it runs, in whichever process (`RedisFanoutLayer.
channel_is_open`). Nothing is written per connection, and a connection of a process that died is gone at
once. With a layer that cannot tell, no connection counts as present, which errs towards letting the
other connection resume.
"""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer


def connection_present(channel_name: str) -> bool:
    """Whether the connection `channel_name` is open. Sync: called on the web process's database threads,
    whose `async_to_sync` runs the question on the process's event loop (its layer connection)."""
    is_open = getattr(get_channel_layer(), "channel_is_open", None)
    return bool(is_open is not None and async_to_sync(is_open)(channel_name))
