"""The recovery layer's owner: the model named by settings.THINK_OWNER_MODEL, reached through the layer's
foreign keys, checked at start-up, and kept by the migrations of databases made before it was a setting."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from chat.models import Conversation
from recovery.checks import check_recovery_settings
from recovery.conf import DEFAULT_OWNER_MODEL, owner_model_label
from recovery.models import Alarm, Fiber, Incident, Stream, owner_model

BEFORE = [("think_recovery", "0003_fiber_interruption")]
KIND_MIGRATION = ("think_recovery", "0004_fiber_kind_owned_by_its_app")


def test_every_row_of_the_layer_belongs_to_the_configured_owner() -> None:
    assert owner_model_label() == DEFAULT_OWNER_MODEL == "think_chat.Conversation"
    assert owner_model() is Conversation
    for model in (Fiber, Stream, Incident, Alarm):
        assert model._meta.get_field("conversation").related_model is Conversation, model


def test_the_setting_names_the_owner(settings: Any) -> None:
    settings.THINK_OWNER_MODEL = "auth.User"
    assert owner_model_label() == "auth.User"


def test_an_owner_without_a_progress_counter_fails_the_checks(settings: Any) -> None:
    assert check_recovery_settings() == []
    settings.THINK_OWNER_MODEL = "auth.User"  # installed, but with nothing to credit progress to

    [error] = check_recovery_settings()

    assert error.id == "think_recovery.E005"
    assert "auth.User" in error.msg and "progress" in error.msg


@pytest.mark.django_db(transaction=True)
def test_a_database_made_before_the_owner_setting_migrates_and_keeps_its_fibers() -> None:
    """Roll the layer back to the schema of the last release, store a fiber there, and migrate forward:
    the row and its kind are kept, and the migration that made `kind` the owner's changes no SQL."""
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("think_recovery")
    try:
        executor.migrate(BEFORE)
        old = executor.loader.project_state([*BEFORE, *executor.loader.graph.leaf_nodes("think_chat")]).apps
        conversation = old.get_model("think_chat", "Conversation").objects.create(
            agent="assistant", name=f"mig-{uuid.uuid4().hex[:8]}"
        )
        old.get_model("think_recovery", "Fiber").objects.create(
            id=uuid.uuid4(), conversation_id=conversation.pk, request_id="r-old", kind="retry"
        )

        executor = MigrationExecutor(connection)
        plan = [(executor.loader.graph.nodes[KIND_MIGRATION], False)]
        statements = executor.loader.collect_sql(plan)
        executor.migrate(latest)
    finally:
        MigrationExecutor(connection).migrate(latest)

    assert [s for s in statements if not s.lstrip().startswith("--")] == []
    fiber = Fiber.objects.get(conversation_id=conversation.pk, request_id="r-old")
    assert fiber.kind == "retry" and fiber.status == Fiber.Status.PENDING


def test_a_database_other_than_postgres_is_refused(settings: Any) -> None:
    """With SQLite, check and migrate would pass and the first turn would fail."""
    sqlite = {**settings.DATABASES["default"], "ENGINE": "django.db.backends.sqlite3"}
    settings.DATABASES = {**settings.DATABASES, "default": sqlite}

    [error] = check_recovery_settings()

    assert error.id == "think_recovery.E009" and "sqlite3" in error.msg
