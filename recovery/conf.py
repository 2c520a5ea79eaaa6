"""The recovery layer's settings: its keys of the one `THINK` dict, read at access time (so that
override_settings works). The chat app adds its own keys to the same dict (chat.conf)."""

from __future__ import annotations

from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    # Stream buffer: flush at once on the first content, then every N chunks or T ms.
    "FLUSH_EVERY_CHUNKS": 10,
    "FLUSH_INTERVAL_MS": 100,
    # Benchmarks only: False publishes frames without storing segments (no replay, no recovery).
    "STREAM_PERSIST": True,
    # Fiber lease: a worker that has not renewed its lease for LEASE_TTL_S is presumed dead.
    "LEASE_TTL_S": 3.0,
    "HEARTBEAT_INTERVAL_S": 1.0,
    # The period of the recovery tick that celery beat sends (recovery.engine.schedules.beat_schedule
    # takes it; the health check's limit for a stale beat follows it).
    "RECOVERY_TICK_S": 1.0,
    # At most this many interrupted fibers (dead workers' and lapsed leases') are taken over by one
    # recovery tick, and as many by one liveness poll of a worker; the rest wait for the next one. A
    # worker that starts while hundreds are interrupted recovers them in batches, not all at once: each
    # taken fiber becomes a recovery task and then a turn, all behind the same broker queue.
    "RECOVERY_CLAIMS_PER_TICK": 50,
    # Threads each worker process gives its turns' database calls (recovery.process.runtime).
    "DB_THREADS": 8,
    # Each worker process listens for cancels on a Postgres session of its own (recovery.lease.control), so
    # a stop reaches a turn at once. Off behind a pooler that cannot hold a session (PgBouncer in
    # transaction mode): a turn then hears of a cancel at its next flush or heartbeat.
    "CANCEL_SIGNALS": True,
    # Each worker process holds a Postgres session with an advisory lock (recovery.lease.liveness), so a
    # process that dies is noticed by its lost session in about a second instead of by its lease.
    # Off behind a pooler in transaction mode unless LIVENESS_DATABASE names a direct connection.
    "LIVENESS_SESSIONS": True,
    "LIVENESS_DATABASE": "default",  # the DATABASES alias the liveness session connects to
    # How often each live worker looks for the fibers of dead ones; 0: only the recovery tick looks.
    "LIVENESS_POLL_MS": 250,
    # A fiber whose owner's lock is free is taken over by a poll at least this long after another poll
    # first saw it so, if its lease was not renewed in between: a process whose session dropped takes
    # its key back, and renews on every flush tick meanwhile, well inside it.
    "LIVENESS_CONFIRM_MS": 300,
    # Closed incidents (completed, skipped, exhausted, failed) are the admin's audit trail: kept this many
    # days after their last change, then swept hourly; None keeps them (think_prune still deletes on demand).
    "INCIDENT_RETENTION_DAYS": 30,
    # When set, GET /metrics wants "Authorization: Bearer <this>"; when None it is served to loopback only.
    "METRICS_TOKEN": None,
    # GET /healthz answers from its last result this long (seconds; 0: every request checks), so a flood of
    # requests costs the dependencies one round of checks a window, not one each.
    "HEALTH_CACHE_S": 2.0,
}


# The model whose rows own fibers, streams, incidents and alarms, as an "app_label.Model" label. Like
# AUTH_USER_MODEL it is a top-level setting, read once at start-up by the recovery models' foreign keys
# and migrations (which need the owner's table in its app's first migration), and it must not change
# once the tables exist. The one owner in this distribution is the chat app's conversation.
DEFAULT_OWNER_MODEL = "think_chat.Conversation"


def owner_model_label() -> str:
    """The label of the model that owns the recovery layer's rows (settings.THINK_OWNER_MODEL)."""
    return str(getattr(settings, "THINK_OWNER_MODEL", DEFAULT_OWNER_MODEL))


def setting(name: str, defaults: dict[str, Any] = DEFAULTS) -> Any:
    """One THINK setting, falling back to its default."""
    configured: dict[str, Any] = getattr(settings, "THINK", {}) or {}
    if name in configured:
        return configured[name]
    return defaults[name]


def claims_per_tick() -> int:
    """How many interrupted fibers one tick (or one liveness poll) takes over at most:
    THINK["RECOVERY_CLAIMS_PER_TICK"]."""
    return int(setting("RECOVERY_CLAIMS_PER_TICK"))
