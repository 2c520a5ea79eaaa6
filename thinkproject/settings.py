"""Settings of the thinkproject demo site, read from the environment.

Every value has a local default so that `make run` works on a fresh machine with Postgres and Redis
on localhost and no model provider key (the scripted model is used then).
"""

import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import django_stubs_ext
from redis.exceptions import ConnectionError as RedisConnectionError

django_stubs_ext.monkeypatch()

# litellm reaches for the network at import unless this is set first.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def database_from_url(url: str) -> dict[str, Any]:
    """Turn postgres://user:password@host:port/name into a Django DATABASES entry."""
    parsed = urlparse(url)
    if parsed.scheme not in {"postgres", "postgresql"}:
        raise ValueError(f"DATABASE_URL must be a postgres:// URL, got scheme {parsed.scheme!r}")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parsed.path.lstrip("/")) or "thinkproject",
        "USER": unquote(parsed.username or "postgres"),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": parsed.hostname or "127.0.0.1",
        "PORT": str(parsed.port or 5432),
        "CONN_MAX_AGE": int(os.environ.get("DJANGO_CONN_MAX_AGE", "0")),
        "CONN_HEALTH_CHECKS": True,
    }


def development_secret_key(path: Path) -> str:
    """The checkout's own random key for `make run` (DEBUG on): made once, readable by its owner only.
    A key in the repository would let anyone sign a token for any user of a demo reachable by others."""
    from thinkproject.rundir import private_dir, secret_in

    private_dir(path.parent)
    return secret_in(path, nbytes=50)


# Off unless asked for: `make run` asks (DJANGO_DEBUG=1), a deployment does not. With DEBUG off, a public
# or guessable key stops every process at start-up (think_chat.E026, chat/secret_key.py).
DEBUG = env_bool("DJANGO_DEBUG", False)
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or (
    development_secret_key(BASE_DIR / ".run" / "secret_key") if DEBUG else ""
)
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",")
# Pages of other origins that may post forms and open the chat socket (full origins: scheme, host, port).
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o]
# Behind a proxy that terminates TLS and sets X-Forwarded-Proto (and strips it from clients): the site's
# own https:// page is same-origin with its wss:// socket only if Django knows the request was https.
if env_bool("DJANGO_BEHIND_TLS_PROXY", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

INSTALLED_APPS = [
    # daphne's app only makes `manage.py runserver` serve the ASGI application (the chat socket included);
    # it imports twisted and autobahn, about 0.2 s of every other process's start (a worker's, beat's).
    *(["daphne"] if sys.argv[1:2] == ["runserver"] else []),
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "chat.apps.ChatConfig",
    "recovery.apps.RecoveryConfig",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # daphne does not serve static files; WhiteNoise does, in development and in production.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "thinkproject.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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
ASGI_APPLICATION = "thinkproject.asgi.application"
WSGI_APPLICATION = None

DATABASES = {
    "default": database_from_url(
        os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/thinkproject")
    )
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# Serve straight from the apps' static folders, so `make run` needs no collectstatic step.
WHITENOISE_USE_FINDERS = True
# Where default_storage keeps the files users attach (chat.transcript.files): web and worker processes
# must see the same storage (one machine: this folder; several: a shared one, or S3 and the like through
# django-storages). They are served by the chat app to their conversation's owner, never as /media/.
MEDIA_ROOT = os.environ.get("DJANGO_MEDIA_ROOT") or str(BASE_DIR / ".run" / "media")

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
# The channel layer and the broker should not share a Redis database (keys, eviction, FLUSHDB).
CHANNELS_REDIS_URL = os.environ.get("CHANNELS_REDIS_URL", REDIS_URL.rsplit("/", 1)[0] + "/1")

# Small shared state between processes (e.g. when the recovery tick last ran).
CACHE_REDIS_URL = os.environ.get("CACHE_REDIS_URL", REDIS_URL.rsplit("/", 1)[0] + "/2")
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": CACHE_REDIS_URL}}

CHANNEL_LAYERS: dict[str, Any] = {
    "default": {
        # channels_redis's pub/sub layer, plus one round trip for every turn's frames of a flusher tick
        # (chat/layers.py); channels_redis.core.RedisChannelLayer works too, at a higher cost per frame.
        "BACKEND": "chat.wire.layers.RedisFanoutLayer",
        "CONFIG": {
            # After a Redis restart, pooled connections are dead; retry a command once on a fresh one
            # rather than fail it (redis-py retries nothing by default on a pool it did not create).
            "hosts": [
                {
                    "address": CHANNELS_REDIS_URL,
                    "socket_timeout": 30,
                    "socket_connect_timeout": 5,
                    "retry_on_error": [RedisConnectionError],
                }
            ],
            "prefix": os.environ.get("CHANNELS_PREFIX", "think"),
        },
    }
}

# Celery: every turn is an acks_late task; durability comes from the fiber lease in Postgres.
TURN_HARD_LIMIT_S = int(os.environ.get("THINK_TURN_HARD_LIMIT_S", "900"))
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL)
# kombu's Redis transport, fixed so that a worker survives a broker restart mid-turn (see the module).
CELERY_BROKER_TRANSPORT = (
    "recovery.process.broker:Transport" if CELERY_BROKER_URL.startswith("redis://") else None
)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = TURN_HARD_LIMIT_S
CELERY_TASK_SOFT_TIME_LIMIT = TURN_HARD_LIMIT_S - 30
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # Longer than any turn, so the broker never redelivers a turn that is still running.
    "visibility_timeout": 2 * TURN_HARD_LIMIT_S,
    "unacked_restore_interval": 5,
    "unacked_restore_throttle": 1,
}
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT = 10.0
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

from think_scripted import kwargs as scripted  # noqa: E402

THINK: dict[str, Any] = {
    "AGENTS": {"assistant": "thinkproject.agents.Assistant"},
    # THINK_MODEL names any litellm model; without it the demo talks to its scripted model (no key).
    "MODEL": os.environ.get("THINK_MODEL") or scripted.litellm_kwargs(),
    "LITELLM_MODELS": scripted.LITELLM_MODELS,
    # The demo page works without an account: anonymous visitors own what they open through their
    # session. THINK_ACCESS_POLICY=chat.access.UserAccess requires a login (the apps' default).
    "ACCESS_POLICY": os.environ.get("THINK_ACCESS_POLICY", "chat.access.SessionAccess"),
    "RECOVERY_TICK_S": float(os.environ.get("THINK_RECOVERY_TICK_S", "1")),
    "DB_THREADS": int(os.environ.get("THINK_DB_THREADS", "8")),
    "WEB_DB_THREADS": int(os.environ.get("THINK_WEB_DB_THREADS", "8")),
}
if os.environ.get("THINK_METRICS_TOKEN"):
    THINK["METRICS_TOKEN"] = os.environ["THINK_METRICS_TOKEN"]
if os.environ.get("THINK_STREAM_PERSIST") == "0":  # benchmarks only: measures what durability costs
    THINK["STREAM_PERSIST"] = False
if os.environ.get("THINK_CANCEL_SIGNALS") == "0":  # behind PgBouncer in transaction mode (docs/operations.md)
    THINK["CANCEL_SIGNALS"] = False
if os.environ.get("THINK_LIVENESS_SESSIONS") == "0":  # the lease alone detects a dead worker (same reason)
    THINK["LIVENESS_SESSIONS"] = False
# Admission limits and the recovery batch (README's table; the benchmarks set them for their stacks).
# "none" lifts a limit.
for _key in (
    "MAX_NAME_LENGTH",
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_MESSAGE_PARTS",
    "MAX_TOOL_OUTPUT_BYTES",
    "MAX_FRAME_BURST",
    "PRINCIPAL_OUTPUT_TOKENS_PER_DAY",
    "MAX_QUEUED_TURNS",
    "MAX_NEW_MESSAGES",
    "MAX_BUFFERED_TOOL_UPDATES",
    "MAX_BUFFERED_TOOL_UPDATE_BYTES",
    "MAX_CLIENT_TOOLS_BYTES",
    "PRINCIPAL_MAX_ACTIVE_TURNS",
    "PRINCIPAL_TURNS_PER_MINUTE",
    "PRINCIPAL_TOKENS_PER_DAY",
    "ANONYMOUS_TURNS_PER_MINUTE_PER_ADDRESS",
    "PRINCIPAL_MAX_SOCKETS",
    "ANONYMOUS_SOCKETS_PER_ADDRESS",
    "PRINCIPAL_MAX_CONVERSATIONS",
    "ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS",
    "PRINCIPAL_REPLAYS_PER_MINUTE",
    "RECOVERY_CLAIMS_PER_TICK",
    "MAX_FILE_BYTES",
    "MAX_MESSAGE_FILES",
    "PRINCIPAL_FILE_BYTES_PER_DAY",
    "ANONYMOUS_FILE_BYTES_PER_DAY_PER_ADDRESS",
    "MAX_MODEL_FILE_BYTES",
):
    if os.environ.get(f"THINK_{_key}"):
        _value = os.environ[f"THINK_{_key}"]
        THINK[_key] = None if _value.lower() == "none" else int(_value)
if os.environ.get("THINK_MAX_FRAMES_PER_S"):
    THINK["MAX_FRAMES_PER_S"] = float(os.environ["THINK_MAX_FRAMES_PER_S"])

from recovery.engine.schedules import beat_schedule  # noqa: E402

CELERY_BEAT_SCHEDULE: dict[str, Any] = {**beat_schedule(THINK["RECOVERY_TICK_S"])}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        "LiteLLM": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        # One line per task (a recovery tick every second) is noise; turns log their own outcome.
        "celery.app.trace": {"level": "WARNING"},
        "celery.worker.strategy": {"level": "WARNING"},
    },
}
