"""Who may use which conversation.

Every conversation has an owner: a principal string such as ``"user:42"``. The access policy (the
class THINK["ACCESS_POLICY"] names) turns a WebSocket scope or an HTTP request into the principal
asking, and decides whether that principal may use a conversation. A new conversation belongs to
whoever opens it first; after that, only its owner reads, writes, cancels, clears or resumes it.

The default, `UserAccess`, knows two kinds of credentials:

- the Django session (the browser's cookie), giving ``"user:<pk>"`` for an active, logged-in user;
- a signed token (`issue_token`) in the ``token`` query parameter or an ``Authorization: Bearer``
  header, for clients without the session cookie (native apps, server-side code, the Node client);
  revocable, and refused once its user is gone or inactive (chat.tokens).

`SessionAccess` also lets anonymous visitors in, each owning what they open through their session
(``"session:<hmac>"``, a keyed hash of the session key: never the key itself, which is a credential);
the demo site uses it so that its page works without an account.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from django.utils.crypto import salted_hmac
from django.utils.module_loading import import_string

from .conf import think_setting
from .exceptions import AccessDenied
from .tokens import TOKEN_SALT as TOKEN_SALT  # re-exported: chat.access is where sites import tokens from
from .tokens import issue_token as issue_token
from .tokens import token_principal
from .transcript.quotas import conversation_get_or_create_within
from .transcript.selectors import conversation_get
from .transcript.services import conversation_get_or_create

if TYPE_CHECKING:
    from django.http import HttpRequest

    from .models import Conversation

TOKEN_PARAM = "token"
SESSION_PRINCIPAL_SALT = "think.chat.session-principal"


def user_principal(user: Any) -> str | None:
    """``"user:<pk>"`` for an active, authenticated user; None for anyone else."""
    if user is None or not getattr(user, "is_authenticated", False) or not getattr(user, "is_active", True):
        return None
    return f"user:{user.pk}"


def session_principal(session_key: str) -> str:
    """``"session:<hmac>"``, an anonymous visitor's principal: a keyed hash (SECRET_KEY) of the session key.

    Principals are shown in the admin and logs and stored as owners; the session key is the visitor's
    cookie, so a principal must not be one (copied into a ``sessionid`` cookie, it authenticates nobody).
    """
    return "session:" + salted_hmac(SESSION_PRINCIPAL_SALT, session_key, algorithm="sha256").hexdigest()[:32]


@dataclass(frozen=True)
class Credentials:
    """What a connection or a request carries, whatever its transport."""

    user: Any = None
    session_key: str | None = None
    token: str | None = None

    @classmethod
    def from_scope(cls, scope: Mapping[str, Any]) -> Credentials:
        query = parse_qs(bytes(scope.get("query_string") or b"").decode("latin-1"))
        headers = {name.lower(): value for name, value in scope.get("headers") or ()}
        token = _bearer(headers.get(b"authorization", b"").decode("latin-1")) or _first(query, TOKEN_PARAM)
        session = scope.get("session")
        return cls(
            user=scope.get("user"),
            session_key=getattr(session, "session_key", None) if session is not None else None,
            token=token,
        )

    @classmethod
    def from_request(cls, request: HttpRequest) -> Credentials:
        token = _bearer(request.headers.get("Authorization", "")) or request.GET.get(TOKEN_PARAM) or None
        session = getattr(request, "session", None)
        return cls(
            user=getattr(request, "user", None),
            session_key=getattr(session, "session_key", None) if session is not None else None,
            token=token,
        )


def _bearer(header: str) -> str | None:
    scheme, _, value = header.strip().partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def _first(query: dict[str, list[str]], key: str) -> str | None:
    values = query.get(key)
    return values[0] if values and values[0] else None


class AccessPolicy:
    """Subclass to change who a client is (`principal`) or what it may use (`may_access`).

    Methods run in a thread, so they may use the ORM.
    """

    #: Anonymous visitors get a session and own what they open through it (the page creates one).
    anonymous_sessions = False

    def principal(self, credentials: Credentials) -> str:
        """The principal asking; AccessDenied when there is none (or a token is bad).

        A token, when present, wins: a client that sends one means to be that principal, and a bad
        token is refused rather than silently replaced by the session.
        """
        if credentials.token is not None:
            return token_principal(credentials.token)
        principal = user_principal(credentials.user)
        if principal is None and self.anonymous_sessions and credentials.session_key:
            principal = session_principal(credentials.session_key)
        if principal is None:
            raise AccessDenied("authentication required")
        return principal

    def may_access(self, principal: str, conversation: Conversation) -> bool:
        """Whether `principal` may read and write `conversation` (its owner, by default).

        A conversation without an owner (created by server code without one) is nobody's to open.
        """
        return bool(conversation.owner) and conversation.owner == principal


class UserAccess(AccessPolicy):
    """Logged-in Django users (session cookie) and holders of a signed token. The default."""


class SessionAccess(AccessPolicy):
    """As UserAccess, and anonymous visitors too, each owning the conversations of their session."""

    anonymous_sessions = True


@functools.cache
def _policy_class(path: str) -> type[AccessPolicy]:
    cls = import_string(path)
    if not (isinstance(cls, type) and issubclass(cls, AccessPolicy)):
        raise TypeError(f"THINK['ACCESS_POLICY'] {path!r} is not an AccessPolicy subclass")
    return cls


def access_policy() -> AccessPolicy:
    """The configured policy (THINK["ACCESS_POLICY"], a dotted path)."""
    return _policy_class(think_setting("ACCESS_POLICY"))()


def conversation_open(*, agent: str, name: str, credentials: Credentials) -> Conversation:
    """The conversation the caller may use, created for them (they own it) if new; else AccessDenied."""

    policy = access_policy()
    principal = policy.principal(credentials)
    conversation = conversation_get_or_create(agent=agent, name=name, owner=principal)
    if not policy.may_access(principal, conversation):
        raise AccessDenied("this conversation belongs to someone else")
    return conversation


def conversation_read(*, agent: str, name: str, credentials: Credentials) -> Conversation | None:
    """The conversation the caller may read, None when it does not exist yet; else AccessDenied.

    Unlike `conversation_open`, nothing is created (a GET never writes).
    """

    policy = access_policy()
    principal = policy.principal(credentials)
    conversation = conversation_get(agent=agent, name=name)
    if conversation is not None and not policy.may_access(principal, conversation):
        raise AccessDenied("this conversation belongs to someone else")
    return conversation


def conversation_open_as(
    *,
    agent: str,
    name: str,
    principal: str,
    policy: AccessPolicy | None = None,
    address: str | None = None,
) -> Conversation:
    """`conversation_open` for a principal already known, from a client `address` (if known). A new
    conversation is refused with ConversationLimit when they own THINK["PRINCIPAL_MAX_CONVERSATIONS"]
    already (the ones they have still open), or, anonymous, their address has opened
    THINK["ANONYMOUS_NEW_CONVERSATIONS_PER_HOUR_PER_ADDRESS"] new ones in the hour."""
    policy = policy or access_policy()
    conversation = conversation_get_or_create_within(agent=agent, name=name, owner=principal, address=address)
    if not policy.may_access(principal, conversation):
        raise AccessDenied("this conversation belongs to someone else")
    return conversation
