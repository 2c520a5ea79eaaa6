"""chat.caching: one cache instance for the process where the backend allows it, Django's otherwise."""

from __future__ import annotations

import threading
from typing import Any

from django.core.cache import caches
from django.core.cache.backends.dummy import DummyCache
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.redis import RedisCache

from chat.caching import shared_cache, shared_redis


def test_the_redis_cache_is_one_instance_across_threads() -> None:
    seen: list[Any] = []
    threads = [threading.Thread(target=lambda: seen.append(shared_cache())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert isinstance(seen[0], RedisCache)
    assert all(backend is seen[0] for backend in seen), "the same instance in every thread"
    assert shared_redis() is not None


def test_a_changed_setting_makes_a_new_instance_and_an_unknown_backend_is_djangos(settings: Any) -> None:
    redis_backend = shared_cache()
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    local = shared_cache()
    assert isinstance(local, LocMemCache) and shared_cache() is local
    assert shared_redis() is None, "no Redis client: socket slots fall back to the process's own count"
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"}}
    assert isinstance(shared_cache(), DummyCache)
    assert shared_cache() is caches["default"], "not known to be thread-safe: Django's own instance"
    assert redis_backend is not local
