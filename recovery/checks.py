"""System checks of the recovery layer: its keys of the THINK dict and its owner model."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, register
from django.core.checks import Warning as CheckWarning
from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured
from django.db import models

from recovery.conf import owner_model_label, setting

POSITIVE_NUMBERS = (
    "FLUSH_EVERY_CHUNKS",
    "FLUSH_INTERVAL_MS",
    "LEASE_TTL_S",
    "HEARTBEAT_INTERVAL_S",
    "RECOVERY_TICK_S",
    "LIVENESS_CONFIRM_MS",
)


@register()
def check_recovery_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    return [*_check_database(), *_check_numbers(), *_check_switches(), *_check_owner(), *_check_liveness()]


@register(Tags.security, deploy=True)
def check_recovery_deploy(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """What `manage.py check --deploy` says: which detectors of a dead worker are in force, and an open
    metrics endpoint."""
    messages = _detectors_in_force()
    if setting("METRICS_TOKEN"):
        return messages
    return [
        *messages,
        CheckWarning(
            "GET /metrics is served only to a scraper on this machine (THINK['METRICS_TOKEN'] is not set).",
            hint="Set THINK['METRICS_TOKEN'] (the scraper sends it as a bearer token) to scrape it from "
            "another machine or through a proxy.",
            id="think_recovery.W001",
        ),
    ]


def _check_database() -> list[CheckMessage]:
    """The layer's statements are PostgreSQL's (SKIP LOCKED, advisory locks, jsonb, unnest): another
    backend would migrate and then fail at the first turn, so it is refused up front."""
    from django.db.utils import load_backend

    engine = settings.DATABASES.get("default", {}).get("ENGINE", "")
    try:
        vendor = load_backend(engine).DatabaseWrapper.vendor if engine else None
    except ImproperlyConfigured:  # Django reports an unknown backend itself
        return []
    if vendor == "postgresql":
        return []
    return [
        Error(
            f"DATABASES['default'] must be a PostgreSQL database, got {engine or 'none'!r}.",
            hint="Use 'django.db.backends.postgresql' (psycopg 3); the chat and recovery apps keep turns, "
            "streams and their locks in PostgreSQL.",
            id="think_recovery.E009",
        )
    ]


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _check_numbers() -> list[CheckMessage]:
    errors: list[CheckMessage] = [
        Error(f"THINK[{key!r}] must be a positive number, got {value!r}.", id="think_recovery.E001")
        for key in POSITIVE_NUMBERS
        if not _positive_number(value := setting(key))
    ]
    poll = setting("LIVENESS_POLL_MS")
    if not (_positive_number(poll) or poll == 0) or isinstance(poll, bool):
        message = f"THINK['LIVENESS_POLL_MS'] must be a positive number, or 0 (the tick alone), got {poll!r}."
        errors.append(Error(message, id="think_recovery.E001"))
    # Whole numbers: threads of a pool, fibers taken over per tick (a LIMIT).
    for key in ("DB_THREADS", "RECOVERY_CLAIMS_PER_TICK"):
        value = setting(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            errors.append(
                Error(f"THINK[{key!r}] must be a positive integer, got {value!r}.", id="think_recovery.E001")
            )
    cache_s = setting("HEALTH_CACHE_S")
    if not (_positive_number(cache_s) or cache_s == 0) or isinstance(cache_s, bool):
        message = f"THINK['HEALTH_CACHE_S'] must be a positive number, or 0 (no cache), got {cache_s!r}."
        errors.append(Error(message, id="think_recovery.E001"))
    retention = setting("INCIDENT_RETENTION_DAYS")
    if retention is not None and not _positive_number(retention):
        message = f"THINK['INCIDENT_RETENTION_DAYS'] must be a positive number or None, got {retention!r}."
        errors.append(Error(message, id="think_recovery.E001"))
    heartbeat, ttl = setting("HEARTBEAT_INTERVAL_S"), setting("LEASE_TTL_S")
    if _positive_number(heartbeat) and _positive_number(ttl) and heartbeat >= ttl:
        errors.append(
            Error(
                "THINK['HEARTBEAT_INTERVAL_S'] must be shorter than THINK['LEASE_TTL_S'].",
                hint="A lease that is renewed less often than it expires is always expired.",
                id="think_recovery.E002",
            )
        )
    return errors


def _check_switches() -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    if not isinstance(setting("CANCEL_SIGNALS"), bool):
        errors.append(Error("THINK['CANCEL_SIGNALS'] must be True or False.", id="think_recovery.E003"))
    token = setting("METRICS_TOKEN")
    if token is not None and not (isinstance(token, str) and token):
        errors.append(
            Error("THINK['METRICS_TOKEN'] must be None or a non-empty string.", id="think_recovery.E004")
        )
    return errors


def _check_owner() -> list[CheckMessage]:
    """The owner model must carry the progress counter the stream's writes credit (recovery.stream.buffer) and
    the budget reads (recovery.engine.store). Django itself reports an owner that is not installed."""
    label = owner_model_label()
    try:
        owner = apps.get_model(label)
    except (LookupError, ValueError):
        return []  # fields.E300 on the recovery models says it
    try:
        progress = owner._meta.get_field("progress")
    except FieldDoesNotExist:
        progress = None
    if not isinstance(progress, models.BigIntegerField):
        return [
            Error(
                f"The owner model {label} (settings.THINK_OWNER_MODEL) has no BigIntegerField 'progress'.",
                hint="The recovery layer credits streamed work to it and its budget reads it: add "
                "`progress = models.BigIntegerField(default=0)` to the owner model.",
                id="think_recovery.E005",
            )
        ]
    return []


def _check_liveness() -> list[CheckMessage]:
    """The liveness settings (recovery.lease.liveness) hold together."""
    enabled, alias = setting("LIVENESS_SESSIONS"), setting("LIVENESS_DATABASE")
    if not isinstance(enabled, bool):
        return [Error("THINK['LIVENESS_SESSIONS'] must be True or False.", id="think_recovery.E006")]
    if not enabled:
        return []
    if not (isinstance(alias, str) and alias in settings.DATABASES):
        return [
            Error(
                f"THINK['LIVENESS_DATABASE'] must name an entry of DATABASES, got {alias!r}.",
                id="think_recovery.E007",
            )
        ]
    confirm, interval = setting("LIVENESS_CONFIRM_MS"), setting("FLUSH_INTERVAL_MS")
    if _positive_number(confirm) and _positive_number(interval) and confirm < 3 * interval:
        return [
            Error(
                "THINK['LIVENESS_CONFIRM_MS'] must be at least three flush intervals (FLUSH_INTERVAL_MS): "
                "a worker that lost its session renews its leases once per flush tick meanwhile.",
                id="think_recovery.E008",
            )
        ]
    return []


def _detectors_in_force() -> list[CheckMessage]:
    """Which detectors of a dead worker are in force, and whether the session one can work (a pooler)."""
    enabled, alias = setting("LIVENESS_SESSIONS"), setting("LIVENESS_DATABASE")
    ttl = setting("LEASE_TTL_S")
    if enabled is False:
        return [
            CheckWarning(
                "A dead worker's turns are detected by their lease alone (THINK['LIVENESS_SESSIONS'] is "
                f"off): they resume LEASE_TTL_S ({ttl} s) and a tick after it died.",
                hint="Behind a pooler in transaction mode, give the liveness session a direct connection "
                "(THINK['LIVENESS_DATABASE']) and turn it on (docs/operations.md).",
                id="think_recovery.W002",
            )
        ]
    database = settings.DATABASES.get(alias) if isinstance(alias, str) else None
    if enabled is not True or database is None:
        return []  # check_recovery_settings reports it
    messages: list[CheckMessage] = []
    if database.get("DISABLE_SERVER_SIDE_CURSORS") or str(database.get("PORT", "")) == "6432":
        messages.append(
            CheckWarning(
                f"DATABASES[{alias!r}] looks like a pooler (PgBouncer): a session lock does not survive "
                "transaction pooling, so the liveness session would watch nothing.",
                hint="Point THINK['LIVENESS_DATABASE'] at a direct connection to Postgres, or set "
                "THINK['LIVENESS_SESSIONS'] = False to rely on the lease alone.",
                id="think_recovery.W003",
            )
        )
    messages.append(
        Info(
            f"A dead worker's turns are detected by its lost liveness session (DATABASES[{alias!r}]) "
            f"within about {setting('LIVENESS_CONFIRM_MS')} ms and two polls, and by its lease "
            f"({ttl} s) when the session cannot tell (a frozen process, a lost host).",
            id="think_recovery.I001",
        )
    )
    return messages
