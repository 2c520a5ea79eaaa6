"""Test settings: the demo settings on their own Redis databases, so tests never touch a running dev stack.

Processes started by the tests (worker, daphne) use these settings too, pointed at pytest's test
database through THINK_TEST_DATABASE_NAME.
"""

import os

from thinkproject.settings import *  # noqa: F403
from thinkproject.settings import CHANNEL_LAYERS, DATABASES, REDIS_URL, THINK

TEST_REDIS_BASE = os.environ.get("THINK_TEST_REDIS_URL", REDIS_URL.rsplit("/", 1)[0])
CELERY_BROKER_URL = f"{TEST_REDIS_BASE}/14"
CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]["address"] = f"{TEST_REDIS_BASE}/15"
CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = "thinktest"

if os.environ.get("THINK_TEST_DATABASE_NAME"):
    DATABASES["default"]["NAME"] = os.environ["THINK_TEST_DATABASE_NAME"]
    DATABASES["default"]["TEST"] = {"NAME": os.environ["THINK_TEST_DATABASE_NAME"]}

THINK = {**THINK, "GROUP_PREFIX": "thinktest"}
SECRET_KEY = "tests-only"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
