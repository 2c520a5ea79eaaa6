"""The THINK settings dict, read at access time so that override_settings works."""

from __future__ import annotations

import os
from typing import Any

from recovery.conf import DEFAULTS as RECOVERY_DEFAULTS
from recovery.conf import setting

DEFAULTS: dict[str, Any] = {
    # The recovery layer's keys (flush policy, leases, the tick, ...): recovery.conf.
    **RECOVERY_DEFAULTS,
    # Agent name (as used in the URL, kebab-case) -> dotted path of a Think subclass.
    "AGENTS": {"assistant": "chat.agents.Assistant"},
    # A litellm model string or a dict of completion kwargs; None picks the scripted model.
    "MODEL": None,
    "SCRIPTED_MODEL_URL": "http://127.0.0.1:8765/v1",
    # A connection following a live stream that hears nothing of it for this long reads the store:
    # chunks the channel layer lost, and the end of a stream that ended (chat.silence).
    "STREAM_SILENCE_MS": 2000,
    # Prefix of channel-layer group names, one group per conversation.
    "GROUP_PREFIX": "think",
    # Who may use which conversation (chat.access): a dotted path to an AccessPolicy subclass.
    "ACCESS_POLICY": "chat.access.UserAccess",
    # How long a token from chat.access.issue_token (or `manage.py think_token`) is accepted.
    "TOKEN_MAX_AGE_S": 3600,
    # Longest conversation name the consumer accepts.
    "MAX_NAME_LENGTH": 200,
    # Limits on client input (chat.limits); anything beyond one is refused and nothing is stored.
    "MAX_FRAME_BYTES": 1_000_000,  # one WebSocket frame (a chat request carries the whole transcript)
    "MAX_MESSAGE_BYTES": 256_000,  # the JSON of one new UIMessage in a chat request
    "MAX_MESSAGE_PARTS": 200,  # parts of one new UIMessage
    "MAX_TOOL_OUTPUT_BYTES": 256_000,  # the JSON of one cf_agent_tool_result output
    "MAX_QUEUED_TURNS": 10,  # turns waiting behind a busy one, per conversation ("queue" policy)
    "MAX_FRAMES_PER_S": 20.0,  # frames per connection per second, after a burst of ...
    "MAX_FRAME_BURST": 100,
}


def think_setting(name: str) -> Any:
    """Return one THINK setting, falling back to its default."""
    return setting(name, DEFAULTS)


def default_model() -> str | dict[str, Any]:
    """The model used by agents that do not override get_model()."""
    model = think_setting("MODEL")
    if model:
        return model  # type: ignore[no-any-return,unused-ignore]
    return scripted_model()


def scripted_model() -> dict[str, Any]:
    """litellm kwargs for the local scripted OpenAI-compatible server."""
    url = os.environ.get("SCRIPTED_MODEL_URL") or think_setting("SCRIPTED_MODEL_URL")
    return {"model": "openai/scripted", "api_base": url, "api_key": "sk-scripted"}
