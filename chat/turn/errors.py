"""Model errors a turn recovers from: rate limits and transient provider failures.

`default_chat_error_classifier`, Think's default `classify_chat_error`, names them by type, never by
wording: litellm's `RateLimitError` (or any provider error with HTTP status 429) is "rate_limit"; a 5xx,
an unavailable or overloaded provider, a bad gateway, a timeout, a lost connection and a broken or
malformed stream (litellm's `MidStreamFallbackError`, `APIConnectionError`) are "transient".
Context-window overflows are "context_overflow" (see `chat.turn.overflow`). Anything else (a refused
request, bad credentials, a bug) is left unclassified and ends the turn at once, as before.

A turn whose error is "rate_limit" or "transient" is handed to recovery (see `chat.turn.runner`), which
waits a little (`recovery.budget.incidents.transient_wait_s`) and continues it from what was stored.
"""

from __future__ import annotations

import email.utils
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

from ..exceptions import ResponseFailed
from .overflow import ChatErrorContext, default_context_overflow_classifier

RATE_LIMIT = "rate_limit"
TRANSIENT = "transient"
RECOVERABLE = frozenset({RATE_LIMIT, TRANSIENT})

# How far down `original_exception` / `__cause__` / `__context__` a wrapped provider error is looked for.
CAUSE_DEPTH = 8

_RATE_LIMIT_TYPES = ("litellm.exceptions.RateLimitError", "openai.RateLimitError")
_TRANSIENT_TYPES = (
    "litellm.exceptions.InternalServerError",
    "litellm.exceptions.ServiceUnavailableError",  # MidStreamFallbackError is one: a broken stream
    "litellm.exceptions.BadGatewayError",
    "litellm.exceptions.APIConnectionError",
    "litellm.exceptions.Timeout",
    "openai.APIConnectionError",  # APITimeoutError is one
    "openai.InternalServerError",
    "httpx.TransportError",
)
# Statuses that say "the request itself is wrong": retrying it cannot help, whatever wraps it.
_TRANSIENT_STATUSES = frozenset({408, 409, 425})


def _loaded(dotted: str) -> type | None:
    """A class by dotted name if its module is already imported (never import litellm just to classify)."""
    module, _, name = dotted.rpartition(".")
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def _is_any(error: BaseException, dotted_names: tuple[str, ...]) -> bool:
    return any(cls is not None and isinstance(error, cls) for cls in map(_loaded, dotted_names))


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """The error, then what it wraps (litellm's `original_exception`, `__cause__`, `__context__`)."""
    seen: set[int] = set()
    pending = [error]
    while pending and len(seen) < CAUSE_DEPTH:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for inner in (getattr(current, "original_exception", None), current.__cause__, current.__context__):
            if isinstance(inner, BaseException):
                pending.append(inner)


def _provider_status(error: BaseException) -> int | None:
    """The HTTP status of a provider error (litellm's and openai's errors carry one); None otherwise."""
    api_error = _loaded("openai.APIError")
    if api_error is None or not isinstance(error, api_error):
        return None
    status = getattr(error, "status_code", None)
    return status if isinstance(status, int) and not isinstance(status, bool) else None


# The `error.code` of a failed Responses API generation, when it is one the provider may not repeat.
_RESPONSE_FAILURES = {"rate_limit_exceeded": RATE_LIMIT, "server_error": TRANSIENT}


def _kind(error: BaseException) -> str | None:
    """rate_limit, transient, "fatal" (a request the provider refused) or None, for one error alone."""
    status = _provider_status(error)
    if _is_any(error, _RATE_LIMIT_TYPES) or status == 429:
        return RATE_LIMIT
    if _is_any(error, _TRANSIENT_TYPES):
        return TRANSIENT
    if status is not None and (status >= 500 or status in _TRANSIENT_STATUSES):
        return TRANSIENT
    if status is not None and 400 <= status < 500:
        return "fatal"
    if isinstance(error, ConnectionError | TimeoutError):
        return TRANSIENT
    if isinstance(error, ResponseFailed):  # a Responses API generation the provider reported failed
        return _RESPONSE_FAILURES.get(error.code or "")
    return None


def recoverable_kind(error: Any) -> str | None:
    """The error's kind when it (or an error it wraps) is a rate limit or a transient failure, else None.

    A refused request anywhere in the chain wins over a transient wrapper: litellm reports any error in
    the middle of a stream as a `MidStreamFallbackError`, a refusal included, and a refusal must not be
    retried.
    """
    if not isinstance(error, BaseException):
        return None
    kinds = [_kind(e) for e in error_chain(error)]
    if RATE_LIMIT in kinds:
        return RATE_LIMIT
    if "fatal" in kinds:
        return None
    return TRANSIENT if TRANSIENT in kinds else None


def is_refused(error: BaseException) -> bool:
    """Whether the provider refused the request (a 4xx other than a rate limit), here or in what it wraps."""
    return any(_kind(e) == "fatal" for e in error_chain(error))


class DefaultChatErrorClassifier:
    """`classify_chat_error` for every litellm provider: overflows, rate limits and transient failures.

    A callable object rather than a function, so `classify_chat_error = default_chat_error_classifier`
    in a class body is not turned into a method.
    """

    def __call__(self, error: Any, ctx: ChatErrorContext | None = None) -> str | None:
        return default_context_overflow_classifier(error, ctx) or recoverable_kind(error)

    def __repr__(self) -> str:
        return "default_chat_error_classifier"


default_chat_error_classifier = DefaultChatErrorClassifier()


def _header(error: BaseException, name: str) -> str | None:
    """A header of the error's response (or of litellm's `headers`), whatever the case of its name."""
    response = getattr(error, "response", None)
    for headers in (getattr(error, "headers", None), getattr(response, "headers", None)):
        if isinstance(headers, Mapping):
            for key, value in headers.items():
                if str(key).lower() == name:
                    return str(value)
    return None


def _seconds(header: str, *, now: float) -> float | None:
    """A Retry-After value: delay-seconds or an HTTP date."""
    try:
        return max(0.0, float(header))
    except ValueError:
        pass
    parsed = email.utils.parsedate_tz(header)
    return None if parsed is None else max(0.0, email.utils.mktime_tz(parsed) - now)


def retry_after_s(error: Any, *, now: float | None = None) -> float | None:
    """How long the provider asked to wait (``retry-after-ms`` or ``Retry-After``), if it did."""
    if not isinstance(error, BaseException):
        return None
    now = time.time() if now is None else now
    for current in error_chain(error):
        milliseconds = _header(current, "retry-after-ms")
        if milliseconds is not None:
            try:
                return max(0.0, float(milliseconds) / 1000)
            except ValueError:
                pass
        value = _header(current, "retry-after")
        seconds = _seconds(value, now=now) if value is not None else None
        if seconds is not None:
            return seconds
    return None
