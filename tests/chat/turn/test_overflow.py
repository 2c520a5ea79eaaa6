"""The context-overflow classifier and settings."""

from __future__ import annotations

from typing import Any

import pytest

from chat.agents import ContextOverflow, Proactive, Think
from chat.turn.overflow import ChatErrorContext, classify, default_context_overflow_classifier

OVERFLOWS = [
    "prompt is too long: 213450 tokens > 200000 maximum",  # Anthropic
    "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
    "Error code: context_length_exceeded",  # OpenAI code
    "Please reduce the length of the messages.",  # OpenAI
    "The input token count (1048577) exceeds the maximum number of tokens allowed (1048576).",  # Google
    "Input is too long for requested model.",  # Bedrock
    "Too many input tokens: the context window of this model is 32k",  # Mistral
]


@pytest.mark.parametrize("text", OVERFLOWS)
def test_classifies_common_provider_context_overflow_errors(text: str) -> None:
    assert default_context_overflow_classifier(RuntimeError(text)) == "context_overflow"
    assert default_context_overflow_classifier(text) == "context_overflow"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Rate limit reached for requests"),
        RuntimeError("401 Unauthorized"),
        RuntimeError("500 Internal Server Error"),
        "could not reduce the length",
        None,
        {"status": 500},
        ValueError(""),
    ],
)
def test_returns_none_for_unrelated_errors(error: Any) -> None:
    assert default_context_overflow_classifier(error) is None


def test_litellm_context_window_exceeded_error_is_an_overflow_whatever_its_text() -> None:
    import litellm

    error = litellm.ContextWindowExceededError(message="nope", model="m", llm_provider="p")
    error.message = "something a provider said"
    assert default_context_overflow_classifier(error) == "context_overflow"


def test_objects_are_matched_on_their_json() -> None:
    assert (
        default_context_overflow_classifier({"error": {"code": "context_length_exceeded"}})
        == "context_overflow"
    )


def test_the_classifier_as_a_class_attribute_is_not_bound() -> None:
    class Agent(Think):
        classify_chat_error = default_context_overflow_classifier

    agent = Agent(agent="a", name="n")
    assert (
        classify(agent, RuntimeError("prompt is too long"), stage="stream", request_id="r")
        == "context_overflow"
    )


def test_a_classifier_that_raises_or_answers_nonsense_classifies_nothing() -> None:
    class Raising(Think):
        def classify_chat_error(self, error: Any, ctx: ChatErrorContext | None = None) -> str:
            raise RuntimeError("bug")

    class Nonsense(Think):
        def classify_chat_error(self, error: Any, ctx: ChatErrorContext | None = None) -> str:
            return "banana"

    for cls in (Raising, Nonsense):
        assert (
            classify(cls(agent="a", name="n"), RuntimeError("prompt is too long"), stage="s", request_id=None)
            is None
        )


def test_defaults() -> None:
    assert Think.context_overflow is None
    overflow = ContextOverflow(reactive=True, proactive=Proactive(max_input_tokens=1000))
    assert overflow.max_retries == 1
    assert overflow.proactive is not None
    assert (overflow.proactive.headroom, overflow.proactive.max_compactions) == (0.9, 1)
    assert overflow.proactive.threshold == 900


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: Proactive(max_input_tokens=0), "max_input_tokens must be > 0"),
        (lambda: Proactive(max_input_tokens=100, headroom=1.5), "headroom"),
        (lambda: Proactive(max_input_tokens=100, max_compactions=0), "max_compactions must be >= 1"),
        (lambda: ContextOverflow(max_retries=-1), "max_retries"),
        (lambda: ContextOverflow(reactive="yes"), "reactive must be a bool"),  # type: ignore[arg-type]
        (lambda: ContextOverflow(proactive=1000), "proactive must be a Proactive"),  # type: ignore[arg-type]
    ],
)
def test_invalid_settings_are_refused_with_a_message(factory: Any, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        factory()


def test_a_wrong_type_on_the_agent_is_reported_by_the_checks() -> None:
    class Wrong(Think):
        context_overflow = True  # type: ignore[assignment]

    [error] = Wrong.check()
    assert error.id == "think_chat.E016" and "context_overflow must be a ContextOverflow" in error.msg
