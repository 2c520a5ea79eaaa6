"""The default chat error classifier (rate limits and transient provider failures) and Retry-After.

The errors come from litellm itself: raised by its real OpenAI code path against the scripted model, or
built with litellm's own constructors. No database is needed.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import email.utils  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import litellm  # noqa: E402
import pytest  # noqa: E402
from litellm.exceptions import MidStreamFallbackError  # noqa: E402

from chat.agents import Think, default_chat_error_classifier, default_context_overflow_classifier  # noqa: E402
from chat.turn.errors import recoverable_kind, retry_after_s  # noqa: E402
from chat.turn.overflow import classify  # noqa: E402
from think_scripted.server import RATE_LIMIT_RETRY_AFTER_S, ScriptedModelServer  # noqa: E402

litellm.suppress_debug_info = True

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer(token_rate=0) as srv:
        yield srv


async def model_error(server: ScriptedModelServer, prompt: str) -> BaseException:
    """What litellm raises streaming this prompt from the scripted model (the test fails if nothing)."""

    async def run() -> None:
        response = await litellm.acompletion(
            model="openai/scripted",
            api_base=server.url,
            api_key="sk-scripted",
            messages=[{"role": "user", "content": prompt}],
            stream=True,
            num_retries=0,
        )
        async for _ in response:
            pass

    with pytest.raises(Exception) as raised:
        await asyncio.wait_for(run(), 10)
    return raised.value


@pytest.mark.parametrize(
    ("directive", "kind"),
    [
        ("[fail after 0 with 429]", "rate_limit"),
        ("[fail after 0 with 500]", "transient"),
        ("[fail after 0 with 502]", "transient"),
        ("[fail after 0 with 503]", "transient"),
        ("[fail after 0 with 504]", "transient"),
        ("[fail after 3 with 500]", "transient"),  # an error event mid-stream
        # An error event mid-stream: litellm's Chat Completions path keeps no status for it (transient),
        # its Responses API path (a model litellm maps to mode "responses") does (rate_limit).
        ("[fail after 3 with 429]", {"transient", "rate_limit"}),
        ("[malformed after 0]", "transient"),
        ("[malformed after 3]", "transient"),
        ("[reset after 0]", "transient"),
        ("[reset after 3]", "transient"),
        ("[fail after 0 with 400]", None),
        ("[fail after 0 with 401]", None),
        ("[fail after 0 with 403]", None),
        ("[fail after 0 with 404]", None),
        ("[overflow]", "context_overflow"),
    ],
)
async def test_provider_errors_through_litellm_are_classified(
    server: ScriptedModelServer, directive: str, kind: str | set[str] | None
) -> None:
    error = await model_error(server, f"count to 5 {directive}")
    assert default_chat_error_classifier(error) in (kind if isinstance(kind, set) else {kind})


def status_error(cls: Any, status: int, **kwargs: Any) -> BaseException:
    response = httpx.Response(status, request=httpx.Request("POST", "https://provider.test/v1"))
    return cls(message="provider said no", llm_provider="openai", model="m", response=response, **kwargs)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (litellm.RateLimitError("slow down", llm_provider="openai", model="m"), "rate_limit"),
        (litellm.InternalServerError("boom", llm_provider="openai", model="m"), "transient"),
        (litellm.ServiceUnavailableError("down", llm_provider="openai", model="m"), "transient"),
        (litellm.BadGatewayError("gateway", llm_provider="openai", model="m"), "transient"),
        (litellm.APIConnectionError("reset", llm_provider="openai", model="m"), "transient"),
        (litellm.Timeout("too slow", model="m", llm_provider="openai"), "transient"),
        (ConnectionResetError("peer reset"), "transient"),
        (TimeoutError(), "transient"),
        (litellm.AuthenticationError("bad key", llm_provider="openai", model="m"), None),
        (litellm.BadRequestError("bad request", llm_provider="openai", model="m"), None),
        (litellm.NotFoundError("no such model", llm_provider="openai", model="m"), None),
        (litellm.ContentPolicyViolationError("refused", llm_provider="openai", model="m"), None),
        (RuntimeError("Rate limit reached for requests"), None),  # words are not a type
        (RuntimeError("500 Internal Server Error"), None),
        (ValueError("a bug"), None),
        ("429 Too Many Requests", None),
        ({"status": 503}, None),
        (None, None),
    ],
)
def test_litellm_errors_are_classified_by_type_not_wording(error: Any, kind: str | None) -> None:
    assert recoverable_kind(error) == kind
    assert default_chat_error_classifier(error) == kind


def mid_stream(original: Exception) -> BaseException:
    return MidStreamFallbackError(
        "stream broke", model="m", llm_provider="openai", original_exception=original
    )


def test_a_broken_stream_takes_the_kind_of_what_broke_it() -> None:
    connection = litellm.APIConnectionError("reset", llm_provider="openai", model="m")
    assert recoverable_kind(mid_stream(connection)) == "transient"
    assert recoverable_kind(mid_stream(litellm.RateLimitError("slow", llm_provider="openai", model="m"))) == (
        "rate_limit"
    )
    refusal = litellm.ContentPolicyViolationError("refused", llm_provider="openai", model="m")
    assert recoverable_kind(mid_stream(refusal)) is None, "a refusal is not retried, whatever wraps it"


def test_a_wrapped_error_is_found_through_cause_and_context() -> None:
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as inner:
            raise RuntimeError("the SDK gave up") from inner
    except RuntimeError as outer:
        assert recoverable_kind(outer) == "transient"


def test_a_status_alone_decides_for_provider_errors() -> None:
    assert recoverable_kind(status_error(litellm.InternalServerError, 529)) == "transient"
    assert recoverable_kind(status_error(litellm.BadRequestError, 400)) is None


def test_overflows_stay_overflows() -> None:
    overflow = litellm.ContextWindowExceededError(message="too long", model="m", llm_provider="openai")
    assert default_chat_error_classifier(overflow) == "context_overflow"
    assert default_chat_error_classifier("prompt is too long") == "context_overflow"


def test_the_overflow_classifier_alone_does_not_classify_rate_limits_or_transients() -> None:
    error = litellm.RateLimitError("slow down", llm_provider="openai", model="m")
    assert default_context_overflow_classifier(error) is None


def test_think_uses_it_by_default() -> None:
    agent = Think(agent="a", name="n")
    error = litellm.RateLimitError("slow down", llm_provider="openai", model="m")
    assert classify(agent, error, stage="stream", request_id="r") == "rate_limit"


async def test_retry_after_is_read_from_a_real_429(server: ScriptedModelServer) -> None:
    error = await model_error(server, "count to 5 [fail after 0 with 429]")
    assert isinstance(error, litellm.RateLimitError)
    assert retry_after_s(error) == RATE_LIMIT_RETRY_AFTER_S


async def test_a_500_carries_no_retry_after(server: ScriptedModelServer) -> None:
    assert retry_after_s(await model_error(server, "count to 5 [fail after 0 with 500]")) is None


def rate_limit_with(headers: dict[str, str]) -> BaseException:
    response = httpx.Response(429, headers=headers, request=httpx.Request("POST", "https://p.test/v1"))
    return litellm.RateLimitError("slow down", llm_provider="openai", model="m", response=response)


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"Retry-After": "7"}, 7.0),
        ({"retry-after": "2.5"}, 2.5),
        ({"retry-after-ms": "1500", "Retry-After": "9"}, 1.5),  # the finer one wins
        ({"Retry-After": email.utils.formatdate(1_000_030, usegmt=True)}, 30.0),  # an HTTP date
        ({"Retry-After": email.utils.formatdate(999_000, usegmt=True)}, 0.0),  # already past
        ({"Retry-After": "soon"}, None),
        ({}, None),
    ],
)
def test_retry_after_forms(headers: dict[str, str], seconds: float | None) -> None:
    assert retry_after_s(rate_limit_with(headers), now=1_000_000) == seconds


def test_retry_after_from_litellm_headers_and_wrapped_errors() -> None:
    proxied = litellm.RateLimitError("slow", llm_provider="openai", model="m", headers={"Retry-After": "4"})
    assert retry_after_s(proxied) == 4.0
    assert retry_after_s(mid_stream(rate_limit_with({"retry-after": "3"}))) == 3.0
    assert retry_after_s(RuntimeError("Retry-After: 5")) is None
    assert retry_after_s(None) is None
