"""Agents used by the end-to-end tests. Their hooks record what they saw in Redis, so tests can read it."""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from django.conf import settings

from chat.agents import ChatRecovery, ChatRecoveryContext, ChatRecoveryOptions, Think


def probe_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.CACHES["default"]["LOCATION"])


def probe_key(kind: str, name: str) -> str:
    return f"thinktest:{settings.RUN_ID}:{kind}:{name}"  # type: ignore[misc]


def record_exhausted(ctx: Any) -> None:
    """Keyed by the root request id, which is the id of the turn the test client sent."""
    record = {"reason": ctx.reason, "incident_id": ctx.incident_id, "request_id": ctx.request_id}
    probe_redis().rpush(probe_key("exhausted", ctx.recovery_root_request_id), json.dumps(record))


class RecoveryProbe(Think):
    """Records every on_chat_recovery context; the conversation name picks the hook's answer."""

    chat_recovery = ChatRecovery(max_attempts=5, no_progress_timeout_ms=60_000, on_exhausted=record_exhausted)

    async def on_chat_recovery(self, ctx: ChatRecoveryContext) -> ChatRecoveryOptions:
        seen = {
            "kind": ctx.recovery_kind,
            "attempt": ctx.attempt,
            "stream_id": ctx.stream_id,
            "partial_text": ctx.partial_text,
            "created_at": ctx.created_at,
            "request_id": ctx.request_id,
            "root": ctx.recovery_root_request_id,
            "incident_id": ctx.incident_id,
        }
        probe_redis().rpush(probe_key("recovery", self.name), json.dumps(seen))
        # A turn created more than an hour ago is stale: keep its partial, run nothing.
        stale = "stale" in self.name and time.time() * 1000 - ctx.created_at > 3_600_000
        return ChatRecoveryOptions(
            persist="nopersist" not in self.name, continue_="nocontinue" not in self.name and not stale
        )


class StallingAgent(Think):
    """A short stall watchdog and a small budget: a model that always stalls ends in the terminal message."""

    chat_stream_stall_timeout_ms = 1500
    chat_recovery = ChatRecovery(
        max_attempts=3,
        no_progress_timeout_ms=4000,
        terminal_message="Sorry: the model kept stalling.",
        on_exhausted=record_exhausted,
    )
