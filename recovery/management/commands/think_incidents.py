"""List recovery incidents: open and exhausted ones by default."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from recovery.models import Incident
from recovery.operations import actions

DEFAULT_STATUSES = [*actions.OPEN_INCIDENTS, Incident.Status.EXHAUSTED]
COLUMNS = [
    ("conversation", "CONVERSATION"),
    ("incident_id", "INCIDENT"),
    ("status", "STATUS"),
    ("reason", "REASON"),
    ("attempts", "ATTEMPTS"),
    ("first_seen_at", "FIRST SEEN"),
    ("last_attempt_at", "LAST ATTEMPT"),
]


class Command(BaseCommand):
    help = "List recovery incidents (open and exhausted by default), newest first, as a table or JSON."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--status",
            action="append",
            choices=Incident.Status.values,
            help="only this status (repeatable); default: detected, scheduled, attempting, exhausted",
        )
        parser.add_argument("--json", action="store_true", help="one JSON array instead of a table")

    def handle(self, *args: Any, **options: Any) -> None:
        rows = actions.incidents_report(statuses=options["status"] or DEFAULT_STATUSES)
        if options["json"]:
            self.stdout.write(json.dumps(rows, indent=2))
        elif not rows:
            self.stdout.write("No incidents.")
        else:
            self.stdout.write(table(rows))


def table(rows: list[dict[str, Any]]) -> str:
    cells = [
        [
            str({**row, "attempts": f"{row['attempt']}/{row['max_attempts']}"}[key] or "-")
            for key, _ in COLUMNS
        ]
        for row in rows
    ]
    header = [title for _, title in COLUMNS]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *cells]
    )
