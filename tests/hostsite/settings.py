"""Settings of a host site that embeds `chat` and `recovery` as an existing Django site would.

It owns everything the demo project owns for itself: a custom user model (`accounts.User`), its URLs
(the chat under /support/), its ASGI app, its Celery app, queue and channel-layer prefix. Nothing here
comes from `thinkproject`.

It shares the test machinery of tests/settings.py: the run id (THINK_TEST_RUN_ID) names its queue and
prefixes; the Redis databases are the tests' (13 cache, 14 broker, 15 channel layer); and processes
started by the tests get THINK_TEST_DATABASE_NAME, the database pytest created, so the test can look
at what they stored. Without it, the site's own database is `thinkhost` on the DATABASE_URL server.
"""

import os
import uuid
from typing import Any
from urllib.parse import unquote, urlparse

from redis.exceptions import ConnectionError as RedisConnectionError

from recovery.engine.schedules import beat_schedule

# As in tests/settings.py: a pytest-xdist runner's name is part of the run id.
RUN_ID = os.environ.setdefault("THINK_TEST_RUN_ID", uuid.uuid4().hex[:8]) + os.environ.get(
    "PYTEST_XDIST_WORKER", ""
)
REDIS_BASE = os.environ.get(
    "THINK_TEST_REDIS_URL", os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0]
)

SECRET_KEY = "hostsite-tests-only-key-that-signs-nothing-outside-this-suite-0123"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "tests.hostsite.accounts",
    "chat.apps.ChatConfig",
    "recovery.apps.RecoveryConfig",
]
AUTH_USER_MODEL = "accounts.User"

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "tests.hostsite.urls"
ASGI_APPLICATION = "tests.hostsite.asgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
STATIC_URL = "static/"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"  # the apps' own AppConfigs pin BigAutoField
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

_server = urlparse(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/"))
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("THINK_TEST_DATABASE_NAME") or "thinkhost",
        "USER": unquote(_server.username or "postgres"),
        "PASSWORD": unquote(_server.password or ""),
        "HOST": _server.hostname or "127.0.0.1",
        "PORT": str(_server.port or 5432),
        "TEST": {"NAME": f"test_thinkhost_{RUN_ID}"},
    }
}

# Web and worker processes share presence and the beat's last tick through the cache: Redis.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": f"{REDIS_BASE}/13",
        "KEY_PREFIX": f"thinkhost{RUN_ID}",
    }
}
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [
                {
                    "address": f"{REDIS_BASE}/15",
                    "socket_timeout": 30,
                    "socket_connect_timeout": 5,
                    "retry_on_error": [RedisConnectionError],  # README: survive a Redis restart
                }
            ],
            "prefix": f"thinkhost{RUN_ID}",
        },
    }
}

CELERY_BROKER_URL = f"{REDIS_BASE}/14"
CELERY_BROKER_TRANSPORT = "recovery.process.broker:Transport"  # workers survive a broker restart mid-turn
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = f"thinkhost-{RUN_ID}"
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 1800}  # longer than any turn
CELERY_BEAT_SCHEDULE: dict[str, Any] = {
    **beat_schedule(),
    "hostsite-backend-cleanup": {"task": "celery.backend_cleanup", "schedule": 86400.0},
}

THINK: dict[str, Any] = {
    "AGENTS": {"helpdesk": "tests.hostsite.agents.Helpdesk"},
    "GROUP_PREFIX": "thinkhost",
    # The tests' scripted model, as a host names its own provider's (litellm does not know this one).
    "MODEL": {
        "model": "openai/scripted",
        "api_base": os.environ.get("SCRIPTED_MODEL_URL", "http://127.0.0.1:8765/v1"),
        "api_key": "sk-host",
    },
    "LITELLM_MODELS": {
        "openai/scripted": {"litellm_provider": "openai", "mode": "chat", "supports_native_streaming": True}
    },
}
