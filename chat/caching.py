"""The shared cache (Django's default one) as the chat apps use it: one instance per process.

Django keeps a cache instance per thread and per async context, and every WebSocket consumer runs in a
context of its own: through `django.core.cache.cache`, each socket built a Redis client with a connection
pool of its own, and opened a Redis connection for its first count (its socket slot, its presence): about
6% of the web process's Python time in a burst of short turns (issue 37). The backends known to be safe
across threads (Django's Redis backend, whose pool is thread-safe, and the local-memory one, which locks)
are shared by the whole process here; any other keeps Django's per-context instance.
"""

from __future__ import annotations

import threading
from typing import Any

from django.conf import settings
from django.core.cache import DEFAULT_CACHE_ALIAS, BaseCache, caches
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.redis import RedisCache
from django.utils.module_loading import import_string

SHAREABLE = (RedisCache, LocMemCache)

_lock = threading.Lock()
# The configuration it was made from, and the process's instance (None: the backend is not shareable).
_shared: tuple[dict[str, Any], BaseCache | None] | None = None


def shared_cache() -> BaseCache:
    """The default cache, one instance for the process when its backend allows (made again when the
    CACHES setting changes, as tests change it)."""
    global _shared
    config = settings.CACHES[DEFAULT_CACHE_ALIAS]
    current = _shared
    if current is None or current[0] != config:
        with _lock:
            shareable = issubclass(import_string(config["BACKEND"]), SHAREABLE)
            current = _shared = (
                dict(config),
                caches.create_connection(DEFAULT_CACHE_ALIAS) if shareable else None,
            )
    return current[1] if current[1] is not None else caches[DEFAULT_CACHE_ALIAS]


def shared_redis() -> Any:
    """The shared cache's Redis client, or None when the cache is not Django's Redis backend."""
    backend = shared_cache()
    return backend._cache.get_client(write=True) if isinstance(backend, RedisCache) else None  # type: ignore[attr-defined]
