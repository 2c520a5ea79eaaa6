"""Stop everything of a conversation: its running and queued turns, open submissions, waiting tool calls
and open recovery incidents, in one transaction (chat.transcript.stop)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from recovery.management.options import agent_and_name

from ...models import Conversation
from ...turn.actions import stop_conversation


class Command(BaseCommand):
    help = (
        "Stop a conversation durably: the running turn ends (what it streamed is kept), queued turns and "
        "open submissions are cancelled, approvals and client tool calls still waiting are settled as "
        "cancelled, open recovery incidents are closed so no alarm resumes them. Every connected tab is "
        "told. The next message runs as new work."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("conversation", type=agent_and_name, metavar="AGENT/NAME")

    def handle(self, *args: Any, **options: Any) -> None:
        agent, name = options["conversation"]
        conversation = Conversation.objects.filter(agent=agent, name=name).first()
        if conversation is None:
            raise CommandError(f"no conversation {agent}/{name}")
        report = stop_conversation(conversation.pk)
        for request_id in report.request_ids:
            self.stdout.write(f"turn {request_id}")
        for submission_id in report.submissions:
            self.stdout.write(f"submission {submission_id}")
        for call_id in report.tool_calls:
            self.stdout.write(f"tool call {call_id}")
        for incident_id in report.incidents:
            self.stdout.write(f"incident {incident_id}")
        if not report.stopped_anything:
            self.stdout.write(self.style.SUCCESS(f"{agent}/{name} had nothing to stop."))
            return
        self.stdout.write(
            self.style.SUCCESS(
                f"Stopped {agent}/{name}: {len(report.request_ids)} turn(s), {len(report.submissions)} "
                f"submission(s), {len(report.tool_calls)} tool call(s), {len(report.incidents)} incident(s)."
            )
        )
