"""Approve or deny a tool call that waits for a human's approval, from a shell: the path of a client's
approval (AgentHandle.approve / deny), with no socket open."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from recovery.management.options import agent_and_name

from ...exceptions import ToolCallNotWaiting, UnknownAgent
from ...handle import conversation_handle
from ...models import Conversation


class Command(BaseCommand):
    help = (
        "List the tool calls of a conversation that wait for approval, or approve one (or --deny it, with "
        "--reason). The continuation runs the approved tool on a worker, as if a client had approved it; "
        "a denied call is told to the model. Approving twice changes nothing; a call that does not wait "
        "for approval is refused."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("conversation", type=agent_and_name, metavar="AGENT/NAME")
        parser.add_argument("tool_call_id", nargs="?", help="the call to decide; without it, list them")
        parser.add_argument("--deny", action="store_true", help="deny the call instead of approving it")
        parser.add_argument("--reason", default=None, help="why it is denied (the model reads it)")

    def handle(self, *args: Any, **options: Any) -> None:
        agent, name = options["conversation"]
        conversation = Conversation.objects.filter(agent=agent, name=name).first()
        if conversation is None:
            raise CommandError(f"no conversation {agent}/{name}")
        try:
            handle = conversation_handle(conversation.pk)
        except UnknownAgent as exc:
            raise CommandError(f"agent {agent!r} is not registered in THINK['AGENTS']") from exc
        call_id = options["tool_call_id"]
        if options["reason"] is not None and not options["deny"]:
            raise CommandError("--reason goes with --deny")
        if call_id is None:
            waiting = handle.waiting_approvals()
            for call in waiting:
                arguments = json.dumps(call["input"], ensure_ascii=False)
                self.stdout.write(f"{call['toolCallId']}  {call['tool']} {arguments}")
            if not waiting:
                self.stdout.write(f"No tool call of {agent}/{name} waits for approval.")
            return
        try:
            if options["deny"]:
                decision = handle.deny(call_id, options["reason"])
            else:
                decision = handle.approve(call_id)
        except (ToolCallNotWaiting, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        verb = "Denied" if options["deny"] else "Approved"
        if decision.status == "noop":
            self.stdout.write(self.style.SUCCESS(f"{verb} already: {call_id} (nothing changed)."))
            return
        line = f"{verb} {call_id}."
        if decision.continuation_request_id:
            line += f" The turn continues as {decision.continuation_request_id}."
        if decision.refused:
            line += f" The turn did not continue: {decision.refused}."
        self.stdout.write(self.style.SUCCESS(line))
