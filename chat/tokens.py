"""Access tokens: signed, short-lived, and revocable.

A token (`issue_token`) carries its principal, an id of its own and the moment it was issued, signed
with SECRET_KEY. It is accepted (`token_principal`) while all of these hold:

- its signature is good and it is younger than THINK["TOKEN_MAX_AGE_S"];
- it was not revoked: neither by its id (`revoke_token`) nor by a "not before" of its principal later
  than its issue (`revoke_principal_tokens`: every token issued so far, a version bump);
- for a ``"user:<pk>"`` principal, that user still exists and is active.

The checks after the signature are one database statement, once per connect and per get-messages
request; it reads the user's row itself (its table's `is_active`, when the model has one), not through
the user model's manager.
Tokens of the first format (a bare principal, no id) cannot be revoked by id and are refused.
"""

from __future__ import annotations

import datetime
import functools
import time
import uuid
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.core import signing
from django.core.exceptions import ValidationError
from django.db import connection

from .conf import think_setting
from .exceptions import AccessDenied
from .models import TokenRevocation

TOKEN_SALT = "think.chat.access-token"
USER_PREFIX = "user:"  # chat.access.user_principal


@dataclass(frozen=True)
class TokenClaims:
    """What a well-signed, unexpired token says."""

    principal: str
    token_id: str
    issued_at: datetime.datetime


def issue_token(principal: str) -> str:
    """A signed token standing for `principal`, valid for THINK["TOKEN_MAX_AGE_S"] unless revoked.

    Give it to a client that cannot send the session cookie: it connects with ``?token=<token>``
    (or an ``Authorization: Bearer <token>`` header, where the client can set headers).
    """
    if not principal:
        raise ValueError("a token needs a non-empty principal")
    claims = {"p": principal, "id": uuid.uuid4().hex, "iat": time.time()}
    return signing.dumps(claims, salt=TOKEN_SALT, compress=True)


def token_claims(token: str, *, max_age: float | None = None) -> TokenClaims:
    """The claims of a token whose signature is good and (with `max_age`) not expired; else AccessDenied.

    Reads no database: whether the token is revoked, or its user inactive, is `token_principal`'s."""
    try:
        age = datetime.timedelta(seconds=max_age) if max_age is not None else None
        payload = signing.loads(token, salt=TOKEN_SALT, max_age=age)
    except signing.SignatureExpired as exc:
        raise AccessDenied("the access token has expired") from exc
    except signing.BadSignature as exc:
        raise AccessDenied("the access token is not valid") from exc
    if not isinstance(payload, dict):  # also the first format, a bare principal: it has no id to revoke
        raise AccessDenied("the access token is not valid")
    principal, token_id, issued = payload.get("p"), payload.get("id"), payload.get("iat")
    if not (isinstance(principal, str) and principal and isinstance(token_id, str) and token_id):
        raise AccessDenied("the access token is not valid")
    if not isinstance(issued, int | float) or isinstance(issued, bool):
        raise AccessDenied("the access token is not valid")
    issued_at = datetime.datetime.fromtimestamp(issued, tz=datetime.UTC)
    return TokenClaims(principal=principal, token_id=token_id, issued_at=issued_at)


def token_principal(token: str) -> str:
    """The principal a token stands for; AccessDenied when it is forged, malformed, expired or revoked,
    or names a user who no longer exists or is not active. Reads the database."""
    claims = token_claims(token, max_age=think_setting("TOKEN_MAX_AGE_S"))
    user_pk: Any = None
    if claims.principal.startswith(USER_PREFIX):
        try:
            user_pk = get_user_model()._meta.pk.to_python(claims.principal.removeprefix(USER_PREFIX))
        except ValidationError:  # not a primary key of this user model
            raise AccessDenied("the access token's user is not active") from None
    revoked, active = _token_state(claims, user_pk)
    if revoked:
        raise AccessDenied("the access token has been revoked")
    if user_pk is not None and not active:
        raise AccessDenied("the access token's user is not active")
    return claims.principal


def _token_state(claims: TokenClaims, user_pk: Any) -> tuple[bool, bool | None]:
    """Whether the token is revoked, and whether its user (`user_pk`, None for another principal) exists
    and is active (None when there is no such user): one statement per connect, not two ORM reads."""
    params: list[Any] = [claims.token_id, claims.principal, claims.issued_at]
    with connection.cursor() as cursor:
        if user_pk is None:
            cursor.execute(_token_sql(with_user=False), params)
        else:
            cursor.execute(_token_sql(with_user=True), [*params, user_pk])
        revoked, active = cursor.fetchone()
    return bool(revoked), active


@functools.cache
def _token_sql(*, with_user: bool) -> str:
    quote = connection.ops.quote_name
    user = get_user_model()._meta
    active_field = next((f for f in user.concrete_fields if f.name == "is_active"), None)
    active = quote(active_field.column) if active_field is not None else "TRUE"
    user_sql = f"(SELECT {active} FROM {quote(user.db_table)} WHERE {quote(user.pk.column)} = %s)"
    return (
        f"SELECT EXISTS (SELECT 1 FROM {quote(TokenRevocation._meta.db_table)}"
        " WHERE token_id = %s OR (token_id = '' AND principal = %s AND not_before > %s)), "
        + (user_sql if with_user else "NULL")
    )


def revoke_token(token_or_id: str) -> TokenClaims | str:
    """Refuse one token from now on: the token itself (its signature is checked, not its age) or its id
    (as `manage.py think_token` prints it). Returns the claims, or the id when given one."""
    if ":" in token_or_id:
        claims = token_claims(token_or_id)
        TokenRevocation.objects.get_or_create(
            token_id=claims.token_id, defaults={"principal": claims.principal}
        )
        return claims
    token_id = token_or_id.strip()
    if not token_id:
        raise ValueError("no token or token id to revoke")
    TokenRevocation.objects.get_or_create(token_id=token_id)
    return token_id


def revoke_principal_tokens(principal: str, *, before: datetime.datetime | None = None) -> datetime.datetime:
    """Refuse every token of `principal` issued before `before` (now); tokens issued later are accepted.
    Returns the moment."""
    if not principal:
        raise ValueError("no principal to revoke the tokens of")
    moment = before or datetime.datetime.now(tz=datetime.UTC)
    TokenRevocation.objects.update_or_create(
        token_id="", principal=principal, defaults={"not_before": moment}
    )
    return moment
