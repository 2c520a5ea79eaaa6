"""The Celery broker transport: kombu's Redis transport, made to survive a broker restart mid-turn.

When a worker loses its broker connection, Celery 5.7 first collects the connection (which detaches
its kombu transport) and then closes it. Closing the Redis channel puts its unacknowledged messages
back, and a worker running a turn always holds one (turns are acks_late); with the transport detached,
kombu looks the broker address up on None and raises AttributeError, which Celery takes for an
unrecoverable error: every worker running a turn exited when Redis restarted (measured, see
tests/e2e/test_infra_faults.py). Here a detached channel raises a connection error instead, which
the close path already ignores, so the worker reconnects and its turns carry on.

The messages it could not put back are not needed: a running turn is owned by its fiber lease in
Postgres, and a run_turn delivered again later (kombu restores unacked messages after the visibility
timeout if the broker kept them) finds its fiber taken and does nothing.

Use it with ``CELERY_BROKER_TRANSPORT = "recovery.process.broker:Transport"`` and a ``redis://`` broker URL.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:
            raise RedisConnectionError("the broker connection was closed")
        return super()._connparams(asynchronous=asynchronous)  # type: ignore[misc]  # not in the stubs


class Transport(kombu_redis.Transport):
    Channel = Channel
