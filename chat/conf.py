"""The THINK settings dict, read at access time so that override_settings works."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured

from recovery.conf import DEFAULTS as RECOVERY_DEFAULTS
from recovery.conf import setting

from .protocol import Limits

DEFAULTS: dict[str, Any] = {
    # The recovery layer's keys (flush policy, leases, the tick, ...): recovery.conf.
    **RECOVERY_DEFAULTS,
    # Agent name (as used in the URL, kebab-case) -> dotted path of a Think subclass. None by default:
    # the site names its agents (`manage.py check` says so when it does not).
    "AGENTS": {},
    # The model of agents that do not override get_model(): a litellm model string or a dict of
    # completion kwargs (model, api_base, api_key, ...). None: every agent must say its own.
    "MODEL": None,
    # Models litellm's cost map does not know (a self-hosted or local model), as litellm.register_model
    # takes them: {"openai/my-model": {"litellm_provider": "openai", "mode": "chat"}}.
    "LITELLM_MODELS": {},
    # When a worker imports litellm (about 3 s of CPU and 190 MB): "auto", in the background once it is
    # ready, unless every agent's model is one chat.turn.plain_openai calls without it; True, in the
    # background always; False, when a call first needs it (docs/deployment.md).
    "PRELOAD_LITELLM": "auto",
    # A connection following a live stream that hears nothing of it for this long reads the store:
    # chunks the channel layer lost, and the end of a stream that ended (chat.wire.silence).
    "STREAM_SILENCE_MS": 2000,
    # An HTTP answer (chat.wire.http) with nothing to send for this long sends a comment line, so that
    # proxies and clients that time idle responses out keep it open (a stalled model, a queued turn).
    "HTTP_PING_S": 15.0,
    # Prefix of channel-layer group names, one group per conversation.
    "GROUP_PREFIX": "think",
    # Who may use which conversation (chat.access): a dotted path to an AccessPolicy subclass.
    "ACCESS_POLICY": "chat.access.UserAccess",
    # Browser pages, besides the site's own origin, that may open the chat socket with the visitor's
    # cookies: full origins ("https://app.example.com", "https://*.example.com"); None: Django's
    # CSRF_TRUSTED_ORIGINS (chat.origins).
    "TRUSTED_ORIGINS": None,
    # How long a token from chat.access.issue_token (or `manage.py think_token`) is accepted.
    "TOKEN_MAX_AGE_S": 3600,
    # Longest conversation name the consumer accepts.
    "MAX_NAME_LENGTH": 200,
    # Limits on client input (chat.wire.limits); anything beyond one is refused and nothing is stored.
    "MAX_FRAME_BYTES": 1_000_000,  # one WebSocket frame (a chat request carries the client's transcript)
    "MAX_MESSAGE_BYTES": 256_000,  # the JSON of one new UIMessage in a chat request
    "MAX_MESSAGE_PARTS": 200,  # parts of one new UIMessage
    "MAX_TOOL_OUTPUT_BYTES": 256_000,  # the JSON of one cf_agent_tool_result output
    "MAX_CLIENT_TOOLS_BYTES": 100_000,  # the JSON of the `clientTools` of a chat request or tool result
    # Answers (tool results, approvals) that come while their turn runs wait in one JSON column until it
    # ends: at most this many per conversation, and this many bytes together (chat.transcript.answer_buffer).
    "MAX_BUFFERED_TOOL_UPDATES": 50,
    "MAX_BUFFERED_TOOL_UPDATE_BYTES": 1_000_000,
    # New messages one chat request may add (clients echo the transcript: stored ones do not count).
    "MAX_NEW_MESSAGES": 100,
    # The transcript clients are sent (on connect, after each turn, get-messages): the newest messages
    # whose JSON fits in this many bytes; older ones page back (chat.transcript.window). Well under
    # daphne's 1 MiB message limit, and small enough that a client echoing it in a chat request stays
    # under MAX_FRAME_BYTES.
    "TRANSCRIPT_WINDOW_BYTES": 256_000,
    # The largest WebSocket message the server sends: daphne's (autobahn's) limit, 1 MiB by default; a
    # frame over it is sent smaller (chat.wire.oversize) instead of closing the socket with 1011.
    "MAX_SEND_BYTES": 1_048_576,
    "MAX_QUEUED_TURNS": 10,  # turns waiting behind a busy one, per conversation ("queue" policy)
    # A chat request whose turn no worker has taken this long after it was accepted gets a
    # cf_agent_chat_queued frame (every worker slot busy); one queued behind a turn of its conversation
    # gets it at once (docs/protocol.md).
    "QUEUED_NOTICE_MS": 500,
    # Database threads per web process (chat.wire.pool), each with a connection of its own: the chat
    # socket's and the HTTP wire's calls (accepts, transcripts, replays) run on them side by side.
    "WEB_DB_THREADS": 8,
    "MAX_FRAMES_PER_S": 20.0,  # frames per connection per second, after a burst of ...
    "MAX_FRAME_BURST": 100,
    # Limits per principal (chat.access: a user, a session, a token's subject), over all their sockets and
    # conversations, enforced in Postgres under a per-principal lock; None: no limit. Every turn a client
    # causes is checked: a chat request over one is refused with an error frame and nothing is stored, a
    # continuation a tool answer would start does not start (chat.transcript.quotas, docs/security.md).
    "PRINCIPAL_MAX_ACTIVE_TURNS": 10,  # turns queued or running at once
    "PRINCIPAL_TURNS_PER_MINUTE": 30,  # turns started in the last 60 s (chat requests, continuations)
    "PRINCIPAL_TOKENS_PER_DAY": 5_000_000,  # input + output tokens of the UTC day, as the model reported
    "PRINCIPAL_OUTPUT_TOKENS_PER_DAY": None,  # output tokens of the UTC day
    # Anonymous visitors get a new principal with each session cookie: their turns are also counted per
    # client address (the cache must be shared by the web processes for this to hold across them).
    "ANONYMOUS_TURNS_PER_MINUTE_PER_ADDRESS": 20,
    # What one principal may hold open or ask of the web processes (chat.wire.limits, counted in the shared
    # cache): sockets at once (a new one is closed with 4429), also per client address for anonymous
    # visitors; conversations they own (a new name beyond is closed with 4409, nothing created); replays
    # of stored streams (resume ACKs) a minute. None: no limit.
    "PRINCIPAL_MAX_SOCKETS": 50,
    "ANONYMOUS_SOCKETS_PER_ADDRESS": 200,
    "PRINCIPAL_MAX_CONVERSATIONS": 1000,
    # A new cookie is a new principal: new conversations of anonymous visitors are also counted per client
    # address, for an hour from the first (beyond: closed with 4409, nothing created).
    "ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS": 200,
    "PRINCIPAL_REPLAYS_PER_MINUTE": 60,
    # Files users attach to messages (chat.transcript.files, kept in Django's default_storage): the types
    # accepted (each checked against the bytes), the size of one, files per message, and the bytes one
    # principal may store a UTC day (None: no limit). A file inside a chat request is also bounded by
    # MAX_FRAME_BYTES; bigger ones are uploaded first (chat.wire.files).
    "FILE_TYPES": (
        "image/png",
        "image/jpeg",
        "image/gif",
        "image/webp",
        "application/pdf",
        "text/plain",
        "text/markdown",
        "text/csv",
        "application/json",
    ),
    "MAX_FILE_BYTES": 5_000_000,
    "MAX_MESSAGE_FILES": 10,
    "PRINCIPAL_FILE_BYTES_PER_DAY": 100_000_000,
    # Anonymous visitors get a new principal with each cookie: their files are also counted per client
    # address, for a day from its first (in the shared cache).
    "ANONYMOUS_FILE_BYTES_PER_DAY_PER_ADDRESS": 200_000_000,
    # The bytes of files one model call carries: the newest files first; older ones are named, not sent.
    "MAX_MODEL_FILE_BYTES": 20_000_000,
}


def think_setting(name: str) -> Any:
    """Return one THINK setting, falling back to its default."""
    return setting(name, DEFAULTS)


def default_model() -> str | dict[str, Any]:
    """The model used by agents that do not override get_model(): THINK["MODEL"]."""
    model = think_setting("MODEL")
    if not model:
        raise ImproperlyConfigured(
            "THINK['MODEL'] is not set and the agent does not override get_model(): name a litellm model"
        )
    return model  # type: ignore[no-any-return,unused-ignore]


def frame_limits() -> Limits:
    """The size limits the codec and turn acceptance check, from the THINK settings."""
    return Limits(
        max_frame_bytes=think_setting("MAX_FRAME_BYTES"),
        max_message_bytes=think_setting("MAX_MESSAGE_BYTES"),
        max_message_parts=think_setting("MAX_MESSAGE_PARTS"),
        max_tool_output_bytes=think_setting("MAX_TOOL_OUTPUT_BYTES"),
        max_client_tools_bytes=think_setting("MAX_CLIENT_TOOLS_BYTES"),
    )
