"""Test settings: the demo settings, isolated per test run so runs never disturb each other or a dev stack.

Each pytest run gets a run id; its test database, Celery queue and channel-layer prefix carry it.
Processes started by the tests (worker, daphne) inherit the run id through the environment and are
pointed at pytest's test database through THINK_TEST_DATABASE_NAME. Under pytest-xdist each runner
is a run of its own: the runner's name (PYTEST_XDIST_WORKER, which its processes inherit too) is part
of the id, so two runners never share a queue, a prefix or a database.
"""

import os
import tempfile
import uuid

from thinkproject.settings import *  # noqa: F403
from thinkproject.settings import CHANNEL_LAYERS, DATABASES, REDIS_URL, THINK

RUN_ID = os.environ.setdefault("THINK_TEST_RUN_ID", uuid.uuid4().hex[:8]) + os.environ.get(
    "PYTEST_XDIST_WORKER", ""
)

TEST_REDIS_BASE = os.environ.get("THINK_TEST_REDIS_URL", REDIS_URL.rsplit("/", 1)[0])
CELERY_BROKER_URL = f"{TEST_REDIS_BASE}/14"
# A stack of processes may ask for its own queue, so its workers never take another stack's turns.
CELERY_TASK_DEFAULT_QUEUE = f"thinktest-{RUN_ID}{os.environ.get('THINK_TEST_QUEUE_SUFFIX', '')}"
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": f"{TEST_REDIS_BASE}/13",
        "KEY_PREFIX": f"thinktest{RUN_ID}",
    }
}
CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]["address"] = f"{TEST_REDIS_BASE}/15"
CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = f"thinktest{RUN_ID}"

# The files of a run (chat.transcript.files), shared with the processes it starts (they inherit the id).
MEDIA_ROOT = os.path.join(tempfile.gettempdir(), f"thinktest-media-{RUN_ID}")

if os.environ.get("THINK_TEST_DATABASE_NAME"):
    DATABASES["default"]["NAME"] = os.environ["THINK_TEST_DATABASE_NAME"]
else:
    DATABASES["default"]["TEST"] = {"NAME": f"test_thinkproject_{RUN_ID}"}

THINK = {
    **THINK,
    # Every test is one principal (tests.support.TEST_PRINCIPAL), thousands of turns in a few minutes,
    # two runners at once: the per-principal limits are lifted here. tests/chat/transcript/test_quotas.py runs
    # them, at their defaults too; the README site and `make run` tests run with every default.
    "PRINCIPAL_MAX_ACTIVE_TURNS": None,
    "PRINCIPAL_TURNS_PER_MINUTE": None,
    "PRINCIPAL_TOKENS_PER_DAY": None,
    "ANONYMOUS_TURNS_PER_MINUTE_PER_ADDRESS": None,
    "GROUP_PREFIX": "thinktest",
    "AGENTS": {
        "assistant": "thinkproject.agents.Assistant",
        "recovery-probe": "tests.agents.RecoveryProbe",
        "stalling-agent": "tests.agents.StallingAgent",
        "reattach-agent": "tests.agents.ReattachAgent",
        "flaky-model-agent": "tests.agents.FlakyModelAgent",
        "no-model-recovery-agent": "tests.agents.NoModelRecoveryAgent",
        "tool-agent": "tests.agents.ToolAgent",
        "completion-probe": "tests.agents.CompletionProbe",
        "priced-agent": "tests.agents.PricedAgent",
        "budget-agent": "tests.agents.BudgetAgent",
        "stash-agent": "tests.agents.StashAgent",
        "reactive-agent": "tests.agents.ReactiveAgent",
        "proactive-agent": "tests.agents.ProactiveAgent",
        "both-layers-agent": "tests.agents.BothLayersAgent",
        "litellm-read-agent": "tests.agents.LitellmReadAgent",
        "mcp-agent": "tests.agents.McpAgent",
    },
}
# The one test principal holds many sockets, conversations and replays over a run: those bounds are lifted
# too, unless a test's daphne sets one (THINK_<KEY>, tests/e2e/test_bounds.py).
for _key in (
    "PRINCIPAL_MAX_SOCKETS",
    "ANONYMOUS_SOCKETS_PER_ADDRESS",
    "PRINCIPAL_MAX_CONVERSATIONS",
    "ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS",
    "PRINCIPAL_REPLAYS_PER_MINUTE",
):
    if not os.environ.get(f"THINK_{_key}"):
        THINK[_key] = None
# A stack may stretch the lease, to show what happens before a heartbeat (tests/e2e/test_stop.py), or
# keep its workers from polling for dead ones (the shared stack: it must not take the fibers of the
# stacks that tests kill, which their own workers and beat recover from their own queue), or keep a web
# process from reading a silent stream from Postgres (what it shows then came through the channel layer).
for _key in ("HEARTBEAT_INTERVAL_S", "LEASE_TTL_S", "LIVENESS_POLL_MS", "STREAM_SILENCE_MS"):
    if os.environ.get(f"THINK_TEST_{_key}"):
        THINK[_key] = float(os.environ[f"THINK_TEST_{_key}"])
# A worker may be told when to import litellm (tests/e2e/test_recovery.py: a cold worker without it).
if os.environ.get("THINK_TEST_PRELOAD_LITELLM"):
    THINK["PRELOAD_LITELLM"] = {"0": False, "1": True}.get(
        os.environ["THINK_TEST_PRELOAD_LITELLM"], os.environ["THINK_TEST_PRELOAD_LITELLM"]
    )
# A daphne of a test may send smaller frames (tests/e2e/test_long_conversation.py).
# A daphne of a test may ping idle HTTP answers sooner (tests/e2e/test_http_wire.py).
if os.environ.get("THINK_TEST_HTTP_PING_S"):
    THINK["HTTP_PING_S"] = float(os.environ["THINK_TEST_HTTP_PING_S"])
if os.environ.get("THINK_TEST_MAX_SEND_BYTES"):
    THINK["MAX_SEND_BYTES"] = int(os.environ["THINK_TEST_MAX_SEND_BYTES"])
ROOT_URLCONF = "tests.urls"
# DEBUG is off, as in a deployment, so the key must pass think_chat.E026 (tests/e2e/test_make_run.py and
# tests/support.py sign the test clients' tokens with it).
SECRET_KEY = "tests-only-key-signing-nothing-outside-this-suite-0123456789"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
