"""Limits on client input, from the THINK settings: frame sizes (chat.conf.frame_limits, checked by the
codec), the messages and queue depth a chat request may add (checked when its turn is accepted,
chat.transcript.turns.turn_refusal), each connection's frame rate, the sockets a principal (and an
anonymous visitor's address) may hold open, and the replays of stored streams a principal may ask
for (here).

A frame refused for any of them changes nothing stored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..caching import shared_cache, shared_redis
from ..conf import think_setting


class TokenBucket:
    """`burst` frames at once, then `rate` a second: each frame takes a token, tokens refill over time."""

    def __init__(self, *, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = float(burst)
        self.updated = clock()

    def take(self) -> bool:
        """Take a token for one frame; False (and nothing taken) when the bucket is empty."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def frame_bucket(*, clock: Callable[[], float] = time.monotonic) -> TokenBucket:
    """A connection's bucket, from THINK["MAX_FRAMES_PER_S"] and THINK["MAX_FRAME_BURST"]."""
    rate, burst = think_setting("MAX_FRAMES_PER_S"), think_setting("MAX_FRAME_BURST")
    return TokenBucket(rate=float(rate), burst=int(burst), clock=clock)


# -- open sockets, per principal and per anonymous address ------------------------------------------------
# Each open socket holds a slot in a Redis sorted set (the shared cache's server), scored by when it lapses;
# an open socket renews its slot every SOCKET_RENEW_S, so a web process that dies without closing its
# sockets frees their slots SOCKET_TTL_S later at most.
SOCKET_TTL_S = 90
SOCKET_RENEW_S = 30
ANONYMOUS_PREFIX = "session:"  # chat.access: the principal of an anonymous visitor's session

_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if not redis.call('ZSCORE', KEYS[1], ARGV[3]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class _LocalSlots:
    """The same slots in this process only, when the cache is not Redis (each process counts its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sets: dict[str, dict[str, float]] = {}

    def take(self, key: str, member: str, limit: int, now: float) -> bool:
        with self.lock:
            slots = {m: t for m, t in self.sets.get(key, {}).items() if t > now}
            if member not in slots and len(slots) >= limit:
                self.sets[key] = slots
                return False
            slots[member] = now + SOCKET_TTL_S
            self.sets[key] = slots
            return True

    def renew(self, key: str, member: str, now: float) -> None:
        with self.lock:
            if member in self.sets.get(key, {}):
                self.sets[key][member] = now + SOCKET_TTL_S

    def release(self, key: str, member: str) -> None:
        with self.lock:
            self.sets.get(key, {}).pop(member, None)


_local = _LocalSlots()


def _slot_keys(principal: str, address: str | None) -> list[tuple[str, str, int]]:
    """(cache key, setting, limit) of each count a socket of `principal` from `address` takes a slot in."""
    keys, cache = [], shared_cache()
    most = think_setting("PRINCIPAL_MAX_SOCKETS")
    if most is not None and principal:
        keys.append((cache.make_key(f"think:sockets:{principal}"), "PRINCIPAL_MAX_SOCKETS", most))
    per_address = think_setting("ANONYMOUS_SOCKETS_PER_ADDRESS")
    if per_address is not None and address and principal.startswith(ANONYMOUS_PREFIX):
        keys.append(
            (cache.make_key(f"think:sockets-from:{address}"), "ANONYMOUS_SOCKETS_PER_ADDRESS", per_address)
        )
    return keys


def socket_slots_counted(principal: str, address: str | None) -> bool:
    """Whether a socket of `principal` from `address` takes a slot in any count (none when the bounds
    are lifted: then there is nothing to take, renew or release)."""
    return bool(_slot_keys(principal, address))


def socket_slot_take(*, principal: str, address: str | None, socket: str) -> str:
    """Take the socket's slots; why it may not stay open ("" when it may, and then it holds its slots
    until socket_slot_release)."""
    now = time.time()
    client, taken = shared_redis(), list[str]()
    for key, name, limit in _slot_keys(principal, address):
        if client is not None:
            ok = bool(client.eval(_TAKE, 1, key, now, now + SOCKET_TTL_S, socket, limit, SOCKET_TTL_S * 2))
        else:
            ok = _local.take(key, socket, limit, now)
        if not ok:
            for held in taken:
                _release(client, held, socket)
            if name == "PRINCIPAL_MAX_SOCKETS":
                return f"you already have {limit} connections open; close one first"
            return f"{limit} connections are already open from your address without signing in"
        taken.append(key)
    return ""


def socket_slot_renew(*, principal: str, address: str | None, socket: str) -> None:
    """An open socket keeps its slots another SOCKET_TTL_S."""
    now, client = time.time(), shared_redis()
    for key, _, _ in _slot_keys(principal, address):
        if client is not None:
            client.zadd(key, {socket: now + SOCKET_TTL_S}, xx=True)
            client.expire(key, SOCKET_TTL_S * 2)
        else:
            _local.renew(key, socket, now)


def socket_slot_release(*, principal: str, address: str | None, socket: str) -> None:
    client = shared_redis()
    for key, _, _ in _slot_keys(principal, address):
        _release(client, key, socket)


def _release(client: Any, key: str, socket: str) -> None:
    if client is not None:
        client.zrem(key, socket)
    else:
        _local.release(key, socket)


# -- replays of stored streams ---------------------------------------------------------------------------
def replay_refusal(principal: str) -> str:
    """Why one more replay of a stored stream for `principal` is refused ("" when it is not): more than
    THINK["PRINCIPAL_REPLAYS_PER_MINUTE"] in a minute from its first (counted in the shared cache)."""
    limit = think_setting("PRINCIPAL_REPLAYS_PER_MINUTE")
    if limit is None or not principal:
        return ""
    key = f"think:replays:{principal}"
    cache = shared_cache()
    cache.add(key, 0, timeout=60)
    if cache.incr(key) > limit:
        return f"more than {limit} stream replays a minute; wait a moment"
    return ""
