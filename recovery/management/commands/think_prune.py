"""Delete old stream buffers and closed incidents."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from recovery.management.options import non_negative_float
from recovery.operations import actions


class Command(BaseCommand):
    help = (
        "Delete stream buffers finished more than --streams-older-than minutes ago (abandoned ones after "
        "an hour at least) and closed incidents untouched for more than --incidents-older-than days. "
        "Transcripts are never touched."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--streams-older-than", type=non_negative_float, default=10, metavar="MINUTES")
        parser.add_argument("--incidents-older-than", type=non_negative_float, default=7, metavar="DAYS")
        parser.add_argument("--dry-run", action="store_true", help="count, delete nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        dry_run: bool = options["dry_run"]
        streams = actions.streams_prune(older_than_minutes=options["streams_older_than"], dry_run=dry_run)
        incidents = actions.incidents_prune(older_than_days=options["incidents_older_than"], dry_run=dry_run)
        verb = "Would prune" if dry_run else "Pruned"
        summary = f"{verb} {streams} stream buffer(s) and {incidents} incident(s)."
        self.stdout.write(self.style.SUCCESS(summary))
