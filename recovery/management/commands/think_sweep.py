"""One recovery sweep (what the beat tick does every second), then exit."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from recovery.management.options import positive_int
from recovery.operations import actions


class Command(BaseCommand):
    help = (
        "Run one recovery sweep: claim fibers whose lease expired and alarms that are due, hand them to "
        "the workers, requeue lost turns and settle submissions. Prints the counts."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--limit",
            type=positive_int,
            default=None,
            metavar="N",
            help="claim at most N of each (default: THINK['RECOVERY_CLAIMS_PER_TICK'])",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        counts = actions.recovery_sweep(limit=options["limit"])
        for name, count in counts.items():
            self.stdout.write(f"{name}: {count}")
        self.stdout.write(self.style.SUCCESS("Sweep done."))
