"""The public text of a turn's error: the provider error's class and a fault reference, never its body.

The errors are litellm's own (built with its constructors, each carrying an internal URL in its text).
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from typing import Any  # noqa: E402

import litellm  # noqa: E402
import pytest  # noqa: E402
from litellm.exceptions import MidStreamFallbackError  # noqa: E402

from chat.exceptions import ResponseFailed  # noqa: E402
from chat.turn.faults import is_provider_error, turn_text  # noqa: E402

INTERNAL = "http://vllm.internal:8000/v1"
PROVIDER = {"llm_provider": "openai", "model": "m"}


def overflow() -> BaseException:
    return litellm.ContextWindowExceededError(message=f"window exceeded at {INTERNAL}", **PROVIDER)


@pytest.mark.parametrize(
    ("error", "classification", "text"),
    [
        (overflow(), "context_overflow", "The model provider rejected the request: context window exceeded"),
        (
            litellm.RateLimitError(INTERNAL, **PROVIDER),
            None,
            "The model provider rejected the request: rate limited",
        ),
        (litellm.AuthenticationError(INTERNAL, **PROVIDER), None, "The model provider rejected the request"),
        (litellm.BadRequestError(INTERNAL, **PROVIDER), None, "The model provider rejected the request"),
        (litellm.InternalServerError(INTERNAL, **PROVIDER), None, "The model provider failed"),
        (litellm.APIConnectionError(INTERNAL, **PROVIDER), None, "The model provider failed"),
        (MidStreamFallbackError(message=INTERNAL, **PROVIDER), None, "The model provider failed"),
        (ResponseFailed(INTERNAL, "server_error"), None, "The model provider failed"),
        (RuntimeError(INTERNAL), None, "The turn failed"),  # a bug of the turn, or of a hook
        (KeyError(INTERNAL), None, "The turn failed"),
    ],
)
def test_clients_read_the_class_and_the_reference_only(
    error: Any, classification: str | None, text: str
) -> None:
    shown = turn_text(error, classification, "3f2a9c1e")
    assert shown == f"{text} (error 3f2a9c1e)"
    assert "internal" not in shown


def test_a_provider_error_is_found_through_what_wraps_it() -> None:
    try:
        try:
            raise litellm.InternalServerError(INTERNAL, **PROVIDER)
        except Exception as exc:
            raise RuntimeError("wrapped") from exc
    except RuntimeError as wrapped:
        assert is_provider_error(wrapped)
    assert not is_provider_error(ValueError("a bug"))
