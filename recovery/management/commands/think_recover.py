"""Hand fibers to the recovery engine now, as the tick would: one, a conversation's, or the stale ones."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from recovery.engine.targets import recovery_target
from recovery.management.options import agent_and_name, fiber_id, non_negative_float, positive_int
from recovery.operations import actions


class Command(BaseCommand):
    help = (
        "Force recovery now: the fiber's fencing number is bumped (its worker can write nothing more) and "
        "the engine continues or retries the turn. Finished fibers are refused."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("--fiber", type=fiber_id, metavar="ID", help="one running or interrupted fiber")
        target.add_argument(
            "--conversation",
            type=agent_and_name,
            metavar="AGENT/NAME",
            help="every running or interrupted fiber of a conversation",
        )
        target.add_argument("--stale", action="store_true", help="running fibers whose lease expired")
        parser.add_argument(
            "--older-than",
            type=non_negative_float,
            metavar="SECONDS",
            help="with --stale: leases expired more than this long ago (default 0)",
        )
        parser.add_argument("--limit", type=positive_int, metavar="N", help="with --stale: at most N fibers")
        parser.add_argument("--dry-run", action="store_true", help="list the fibers, change nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["stale"] and (options["older_than"] is not None or options["limit"] is not None):
            raise CommandError("--older-than and --limit go with --stale only")
        dry_run: bool = options["dry_run"]
        try:
            fiber_ids = self._force(options, dry_run=dry_run)
        except actions.OperationRefused as exc:
            raise CommandError(str(exc)) from exc
        for forced in fiber_ids:
            self.stdout.write(forced)
        verb = "Would hand" if dry_run else "Handed"
        self.stdout.write(self.style.SUCCESS(f"{verb} {len(fiber_ids)} fiber(s) to recovery."))

    def _force(self, options: dict[str, Any], *, dry_run: bool) -> list[str]:
        if options["fiber"]:
            return [actions.fiber_force_recover(fiber_id=options["fiber"], dry_run=dry_run)]
        if options["conversation"]:
            agent, name = options["conversation"]
            owner_pk = recovery_target().owner_pk(agent=agent, name=name)
            if owner_pk is None:
                raise CommandError(f"no conversation {agent}/{name}")
            return actions.conversation_force_recover(conversation_id=owner_pk, dry_run=dry_run)
        return actions.fibers_force_recover_stale(
            older_than=options["older_than"] or 0, limit=options["limit"], dry_run=dry_run
        )
