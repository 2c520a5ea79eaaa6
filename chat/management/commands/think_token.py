"""Print an access token for a client that cannot send the session cookie (chat.access)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from chat.access import issue_token, user_principal
from chat.conf import think_setting


class Command(BaseCommand):
    help = (
        "Print a signed access token for a user (or any principal). Clients connect with "
        "?token=<token> or 'Authorization: Bearer <token>'; it is valid for THINK['TOKEN_MAX_AGE_S']."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        who = parser.add_mutually_exclusive_group(required=True)
        who.add_argument("--user", help="the username (USERNAME_FIELD) of an active user")
        who.add_argument("--principal", help='a principal as your access policy spells it, e.g. "user:42"')

    def handle(self, *args: Any, **options: Any) -> None:
        if options["user"] is not None:
            model = get_user_model()
            try:
                user = model._default_manager.get_by_natural_key(options["user"])
            except model.DoesNotExist as exc:
                raise CommandError(f"no user {options['user']!r}") from exc
            principal = user_principal(user)
            if principal is None:
                raise CommandError(f"user {options['user']!r} is not active")
        else:
            principal = options["principal"].strip()
            if not principal:
                raise CommandError("--principal must not be empty")
        self.stdout.write(issue_token(principal))
        self.stderr.write(f"token for {principal}, valid for {think_setting('TOKEN_MAX_AGE_S')} s")
