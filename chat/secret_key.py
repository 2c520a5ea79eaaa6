"""Whether a SECRET_KEY can be trusted to sign what the apps hand out.

Everything a client holds is signed with SECRET_KEY: the session cookie, access tokens
(chat.tokens), anonymous principals (chat.access.session_principal). Whoever knows the key can sign
"user:1" and open user 1's conversations, so a key that is public (the demo's development default, a
compose file's placeholder, Django's `django-insecure-` template) or guessable (short, or made of few
characters: Django's own W009 rule) is refused: by `manage.py check --deploy` (think_chat.E026) always,
and at start-up (the chat app's `ready`) whenever DEBUG is off.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings

MIN_LENGTH = 50  # Django's check_secret_key (security.W009)
MIN_UNIQUE_CHARACTERS = 5
# Words that only a placeholder or a published key carries.
PUBLIC_MARKS = ("django-insecure", "change-me", "changeme", "change_me", "insecure")
HINT = (
    "Set DJANGO_SECRET_KEY (or SECRET_KEY) to a long random value, e.g. "
    "`python -c 'import secrets; print(secrets.token_urlsafe(50))'`, and keep it out of the repository."
)


def secret_key_problem(key: object) -> str | None:
    """What makes `key` unsafe to sign with, or None when nothing does."""
    if not isinstance(key, str | bytes) or not key:
        return "is empty"
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    lowered = text.lower()
    for mark in PUBLIC_MARKS:
        if mark in lowered:
            return f"contains {mark!r}: it is a placeholder or a published key"
    if len(text) < MIN_LENGTH:
        return f"has {len(text)} characters, fewer than {MIN_LENGTH}"
    if len(set(text)) < MIN_UNIQUE_CHARACTERS:
        return f"has {len(set(text))} distinct characters, fewer than {MIN_UNIQUE_CHARACTERS}"
    return None


def secret_key_problems() -> list[str]:
    """Each unsafe key among SECRET_KEY and SECRET_KEY_FALLBACKS, said in a sentence."""
    found = []
    try:
        key = settings.SECRET_KEY
    except Exception:  # Django refuses an empty SECRET_KEY when it is read
        key = ""
    if (problem := secret_key_problem(key)) is not None:
        found.append(f"SECRET_KEY {problem}.")
    fallbacks: Iterable[object] = getattr(settings, "SECRET_KEY_FALLBACKS", ()) or ()
    for index, fallback in enumerate(fallbacks):
        if (problem := secret_key_problem(fallback)) is not None:
            found.append(f"SECRET_KEY_FALLBACKS[{index}] {problem}.")
    return found
