"""The operator commands (think_recover, think_sweep, think_incidents, think_prune) through call_command.

They are thin over recovery.operations.actions (tested in test_operations.py): here, parsing, output
and errors.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from chat.models import Conversation
from recovery.models import Fiber, Incident, Stream
from tests.operator_support import Delays, delays, make_conversation, make_fiber, make_incident
from tests.support import ROOT

__all__ = ["delays"]  # a fixture used by name

pytestmark = pytest.mark.django_db


def run(name: str, *args: str) -> str:
    out = io.StringIO()
    call_command(name, *args, stdout=out, stderr=io.StringIO(), no_color=True)
    return out.getvalue()


@pytest.fixture
def conversation() -> Conversation:
    return make_conversation()


# --------------------------------------------------------------------------------------------------------
# think_recover
# --------------------------------------------------------------------------------------------------------


def test_recover_one_fiber(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    fiber = make_fiber(conversation, Fiber.Status.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        out = run("think_recover", "--fiber", str(fiber.pk))
    assert out.splitlines() == [str(fiber.pk), "Handed 1 fiber(s) to recovery."]
    assert delays.calls == [str(fiber.pk)]
    assert Fiber.objects.get(pk=fiber.pk).status == Fiber.Status.INTERRUPTED


def test_recover_a_conversation_by_agent_and_name(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    fibers = [make_fiber(conversation, status) for status in (Fiber.Status.RUNNING, Fiber.Status.INTERRUPTED)]
    make_fiber(conversation, Fiber.Status.COMPLETED)
    with django_capture_on_commit_callbacks(execute=True):
        out = run("think_recover", "--conversation", f"assistant/{conversation.name}")
    assert sorted(out.splitlines()[:-1]) == sorted(str(f.pk) for f in fibers)
    assert out.splitlines()[-1] == "Handed 2 fiber(s) to recovery."
    assert sorted(delays.calls) == sorted(str(f.pk) for f in fibers)


def test_recover_stale_as_a_dry_run_lists_and_changes_nothing(
    conversation: Conversation, delays: Delays, django_capture_on_commit_callbacks: Any
) -> None:
    make_fiber(conversation, Fiber.Status.RUNNING, lease_in=timedelta(minutes=-10))
    oldest = make_fiber(make_conversation(), Fiber.Status.RUNNING, lease_in=timedelta(minutes=-20))
    make_fiber(make_conversation(), Fiber.Status.RUNNING, lease_in=timedelta(seconds=-5))
    with django_capture_on_commit_callbacks(execute=True):
        out = run("think_recover", "--stale", "--older-than", "60", "--limit", "1", "--dry-run")
    assert out.splitlines() == [str(oldest.pk), "Would hand 1 fiber(s) to recovery."]
    assert delays.calls == []
    assert set(Fiber.objects.values_list("status", flat=True)) == {Fiber.Status.RUNNING}


def test_recover_stale_finds_nothing_when_every_lease_is_live(conversation: Conversation) -> None:
    make_fiber(conversation, Fiber.Status.RUNNING)
    assert run("think_recover", "--stale") == "Handed 0 fiber(s) to recovery.\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "one of the arguments --fiber --conversation --stale is required"),
        (["--stale", "--conversation", "assistant/x"], "not allowed with argument"),
        (["--fiber", "nope"], "'nope' is not a fiber id"),
        (["--conversation", "no-slash"], "'no-slash' is not AGENT/NAME"),
        (["--conversation", "assistant/missing"], "no conversation assistant/missing"),
        (["--stale", "--older-than", "-1"], "'-1' must be a finite number, zero or more"),
        (["--stale", "--older-than", "nan"], "must be a finite number"),
        (["--stale", "--limit", "0"], "'0' must be at least 1"),
        (["--conversation", "assistant/x", "--limit", "3"], "--older-than and --limit go with --stale only"),
    ],
)
def test_recover_rejects_bad_arguments(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        run("think_recover", *args)


def test_recover_refuses_a_finished_fiber(conversation: Conversation, delays: Delays) -> None:
    fiber = make_fiber(conversation, Fiber.Status.COMPLETED)
    with pytest.raises(CommandError, match="is completed: only a running or interrupted fiber"):
        run("think_recover", "--fiber", str(fiber.pk))
    assert delays.calls == []


def test_a_bad_argument_exits_non_zero_with_the_message_on_stderr() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    done = subprocess.run(
        [sys.executable, "manage.py", "think_recover", "--fiber", "nope"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "'nope' is not a fiber id" in done.stderr


# --------------------------------------------------------------------------------------------------------
# think_sweep
# --------------------------------------------------------------------------------------------------------


def test_sweep_runs_one_tick_and_prints_its_counts(conversation: Conversation, delays: Delays) -> None:
    expired = make_fiber(conversation, Fiber.Status.RUNNING, lease_in=timedelta(minutes=-10))
    out = run("think_sweep")
    assert out.splitlines() == [
        "fibers: 1",
        "alarms: 0",
        "requeued: 0",
        "submissions: 0",
        "completions: 0",
        "Sweep done.",
    ]
    assert delays.calls == [str(expired.pk)]


def test_sweep_rejects_a_bad_limit() -> None:
    with pytest.raises(CommandError, match="'-3' must be at least 1"):
        run("think_sweep", "--limit", "-3")


# --------------------------------------------------------------------------------------------------------
# think_incidents
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def incidents(conversation: Conversation) -> dict[str, Incident]:
    return {
        status: make_incident(
            conversation, status, reason="max_attempts_exceeded" if status == "exhausted" else ""
        )
        for status in (Incident.Status.SCHEDULED, Incident.Status.EXHAUSTED, Incident.Status.SKIPPED)
    }


def test_incidents_lists_open_and_exhausted_ones_as_a_table(
    conversation: Conversation, incidents: dict[str, Incident]
) -> None:
    lines = run("think_incidents").splitlines()
    assert lines[0].split() == [
        "CONVERSATION",
        "INCIDENT",
        "STATUS",
        "REASON",
        "ATTEMPTS",
        "FIRST",
        "SEEN",
        "LAST",
        "ATTEMPT",
    ]
    rows = {line.split()[1]: line.split() for line in lines[1:]}
    assert set(rows) == {incidents["scheduled"].incident_id, incidents["exhausted"].incident_id}
    exhausted = rows[incidents["exhausted"].incident_id]
    assert exhausted[:5] == [str(conversation), exhausted[1], "exhausted", "max_attempts_exceeded", "2/6"]
    assert exhausted[5:] == ["2023-11-14T22:13:20+00:00", "2023-11-14T22:13:25+00:00"]
    assert rows[incidents["scheduled"].incident_id][3] == "-", "an empty reason shows as a dash"


def test_incidents_as_json_filtered_by_status(incidents: dict[str, Incident]) -> None:
    rows = json.loads(run("think_incidents", "--json", "--status", "skipped", "--status", "exhausted"))
    assert sorted(row["status"] for row in rows) == ["exhausted", "skipped"]
    assert {row["incident_id"] for row in rows} == {
        incidents["skipped"].incident_id,
        incidents["exhausted"].incident_id,
    }
    assert rows[0]["first_seen_at"] == "2023-11-14T22:13:20+00:00"


def test_incidents_says_so_when_there_are_none(incidents: dict[str, Incident]) -> None:
    assert run("think_incidents", "--status", "failed") == "No incidents.\n"
    assert json.loads(run("think_incidents", "--status", "failed", "--json")) == []


def test_incidents_rejects_an_unknown_status() -> None:
    with pytest.raises(CommandError, match="invalid choice: 'stuck'"):
        run("think_incidents", "--status", "stuck")


# --------------------------------------------------------------------------------------------------------
# think_prune
# --------------------------------------------------------------------------------------------------------


def aged_rows(conversation: Conversation) -> None:
    for minutes in (11, 5):
        row = Stream.objects.create(
            conversation=conversation, request_id="r", message_id="m", status="completed"
        )
        when = timezone.now() - timedelta(minutes=minutes)
        Stream.objects.filter(pk=row.pk).update(created_at=when, completed_at=when)
    for days in (8, 3):
        row = make_incident(conversation, Incident.Status.EXHAUSTED)
        Incident.objects.filter(pk=row.pk).update(updated_at=timezone.now() - timedelta(days=days))


def test_prune_with_the_defaults(conversation: Conversation) -> None:
    aged_rows(conversation)
    assert run("think_prune") == "Pruned 1 stream buffer(s) and 1 incident(s).\n"
    assert (Stream.objects.count(), Incident.objects.count()) == (1, 1)


def test_prune_dry_run_with_custom_ages_deletes_nothing(conversation: Conversation) -> None:
    aged_rows(conversation)
    out = run("think_prune", "--streams-older-than", "1", "--incidents-older-than", "1", "--dry-run")
    assert out == "Would prune 2 stream buffer(s) and 2 incident(s).\n"
    assert (Stream.objects.count(), Incident.objects.count()) == (2, 2)


@pytest.mark.parametrize("option", ["--streams-older-than", "--incidents-older-than"])
def test_prune_rejects_a_negative_age(option: str) -> None:
    with pytest.raises(CommandError, match="must be a finite number, zero or more"):
        run("think_prune", option, "-5")
