"""Print an access token for a client that cannot send the session cookie, or revoke tokens
(chat.access, chat.tokens)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from chat.access import user_principal
from chat.conf import think_setting
from chat.exceptions import AccessDenied
from chat.tokens import issue_token, revoke_principal_tokens, revoke_token, token_claims


class Command(BaseCommand):
    help = (
        "Print a signed access token for a user (or any principal). Clients connect with "
        "?token=<token> or 'Authorization: Bearer <token>'; it is valid for THINK['TOKEN_MAX_AGE_S'] "
        "unless revoked (--revoke one token, --revoke-all of a principal)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        who = parser.add_mutually_exclusive_group(required=True)
        who.add_argument("--user", help="the username (USERNAME_FIELD) of an active user")
        who.add_argument("--principal", help='a principal as your access policy spells it, e.g. "user:42"')
        who.add_argument(
            "--revoke", metavar="TOKEN_OR_ID", help="refuse this token (or token id) from now on"
        )
        who.add_argument(
            "--revoke-all", metavar="PRINCIPAL", help='refuse every token issued so far for "user:42" (say)'
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["revoke"] is not None:
            self._revoke(options["revoke"].strip())
            return
        if options["revoke_all"] is not None:
            principal = options["revoke_all"].strip()
            if not principal:
                raise CommandError("--revoke-all needs a principal")
            moment = revoke_principal_tokens(principal)
            self.stdout.write(f"every token of {principal} issued before {moment.isoformat()} is revoked")
            return
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
        token = issue_token(principal)
        self.stdout.write(token)
        token_id = token_claims(token).token_id
        self.stderr.write(
            f"token {token_id} for {principal}, valid for {think_setting('TOKEN_MAX_AGE_S')} s"
            f" (revoke it with --revoke {token_id})"
        )

    def _revoke(self, token_or_id: str) -> None:
        if not token_or_id:
            raise CommandError("--revoke needs a token or a token id")
        try:
            revoked = revoke_token(token_or_id)
        except AccessDenied as exc:
            raise CommandError(f"not a token of this site: {exc}") from exc
        if isinstance(revoked, str):
            self.stdout.write(f"token {revoked} is revoked")
        else:
            self.stdout.write(f"token {revoked.token_id} of {revoked.principal} is revoked")
