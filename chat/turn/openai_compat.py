"""A lean streaming read of OpenAI-compatible providers, behind the same adapter as litellm's.

litellm still routes and builds every request: the provider, its base URL and key
(`get_llm_provider`), the provider's parameters (`get_optional_params`), the body
(`transform_request`), the URL (`get_complete_url`) and the headers (`validate_environment`); and it
maps every HTTP error to the exception it would raise itself (`exception_type`), so error
classification is unchanged. Only the stream's bytes are read here: one aiohttp connection pool per
event loop, SSE lines, one `json.loads` per event. Measured on the scripted model at 20 tokens/s and
50 concurrent streams, litellm's read costs about 640 us of CPU per token and this one about 85 us
(docs/benchmarks.md); the rest of a turn's work per token is a fraction of either.

Providers whose chat config litellm itself derives from its OpenAI config, and whose base URL is known,
qualify; any other provider, and any agent with `Think.lean_model_read = False`, goes through litellm.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from .llm import (
    Event,
    ReasoningDelta,
    StepFinish,
    TextDelta,
    ToolCallDelta,
    Usage,
    ensure_litellm,
    load_litellm,
)

logger = logging.getLogger(__name__)

# Providers whose streams are OpenAI Chat Completions SSE, event for event (litellm's config for each is
# an OpenAI one, checked again at run time). Others (Anthropic, Gemini, Azure, Ollama's own API) differ.
PROVIDERS = frozenset(
    {
        "openai",
        "hosted_vllm",
        "lm_studio",
        "openrouter",
        "deepseek",
        "groq",
        "together_ai",
        "fireworks_ai",
        "xai",
        "nvidia_nim",
    }
)
OPENAI_BASE = "https://api.openai.com/v1"
# litellm's own keyword arguments: they shape the call, never the provider's request body.
_LITELLM_ONLY = frozenset(
    {"model", "api_base", "base_url", "api_key", "num_retries", "timeout", "extra_headers"}
)
MAX_ERROR_BODY = 64_000

_pool: Any = None  # the worker loop's aiohttp session (recovery.process.runtime), kept for the process


@dataclass(frozen=True)
class LeanRequest:
    url: str
    headers: dict[str, str]
    body: bytes
    model: str
    provider: str
    timeout: float | None


@dataclass(frozen=True)
class _Route:
    """What litellm decided for a model and its parameters: everything of a request but its messages."""

    name: str
    provider: str
    config: Any
    optional: dict[str, Any]
    headers: dict[str, str]
    url: str
    timeout: float | None


def lean_request(model: dict[str, Any], messages: list[Any], **extra: Any) -> LeanRequest | None:
    """The request litellm would send for this streamed call, or None when it is not one to read lean.

    Call after litellm is loaded (it is by the time a turn streams).
    """
    try:
        key = json.dumps({**model, **extra}, sort_keys=True)
    except (TypeError, ValueError):  # parameters that are not JSON: routed every time
        route = _route(model, extra)
    else:
        route = _cached_route(key, model, extra)
    if route is None:
        return None
    body = route.config.transform_request(
        model=route.name, messages=messages, optional_params=route.optional, litellm_params={}, headers={}
    )
    body.update(body.pop("extra_body", None) or {})  # the OpenAI SDK sends extra_body's keys inline
    return LeanRequest(
        url=route.url,
        headers=route.headers,
        body=json.dumps(body).encode(),
        model=route.name,
        provider=route.provider,
        timeout=route.timeout,
    )


_routes: dict[str, _Route | None] = {}
MAX_ROUTES = 256


def _cached_route(key: str, model: dict[str, Any], extra: dict[str, Any]) -> _Route | None:
    """A turn's steps, and every turn of an agent, route the same model the same way: once."""
    if key not in _routes:
        if len(_routes) >= MAX_ROUTES:
            _routes.pop(next(iter(_routes)))
        _routes[key] = _route(model, extra)
    return _routes[key]


def _route(model: dict[str, Any], extra: dict[str, Any]) -> _Route | None:
    litellm = load_litellm()
    from litellm.llms.openai.chat.gpt_transformation import OpenAIGPTConfig
    from litellm.types.utils import LlmProviders
    from litellm.utils import ProviderConfigManager, get_llm_provider, get_optional_params

    kwargs = {**model, **extra}
    try:
        name, provider, dynamic_key, api_base = get_llm_provider(
            model=str(kwargs["model"]), api_base=kwargs.get("api_base") or kwargs.get("base_url")
        )
    except Exception:  # a model string litellm cannot route: let litellm say so, its own way
        return None
    if provider not in PROVIDERS:
        return None
    config = ProviderConfigManager.get_provider_chat_config(model=name, provider=LlmProviders(provider))
    if not isinstance(config, OpenAIGPTConfig):
        return None
    if provider == "openai":
        api_base = (
            api_base or os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE") or OPENAI_BASE
        )
    if not api_base:
        return None
    api_key = kwargs.get("api_key") or dynamic_key
    if api_key is None and provider == "openai":
        api_key = litellm.api_key or litellm.openai_key or os.environ.get("OPENAI_API_KEY")
    params = {k: v for k, v in kwargs.items() if k not in _LITELLM_ONLY}
    optional = get_optional_params(
        model=name,
        custom_llm_provider=provider,
        stream=True,
        stream_options={"include_usage": True},
        **params,
    )
    headers = config.validate_environment(
        headers=dict(kwargs.get("extra_headers") or {}),
        model=name,
        messages=[],
        optional_params=optional,
        litellm_params={},
        api_key=api_key,
        api_base=api_base,
    )
    url = config.get_complete_url(
        api_base=api_base,
        api_key=api_key,
        model=name,
        optional_params=optional,
        litellm_params={},
        stream=True,
    )
    timeout = kwargs.get("timeout")
    return _Route(
        name=name,
        provider=provider,
        config=config,
        optional=optional,
        headers={str(k): str(v) for k, v in headers.items()},
        url=url,
        timeout=float(timeout) if isinstance(timeout, int | float) else None,
    )


def _new_session() -> Any:
    import aiohttp

    # As many connections as there are turns: each stream holds one for its whole length. The proxy
    # from the environment is looked up once per URL (`_proxy`), not on every request.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))


@functools.lru_cache(maxsize=256)
def _proxy(url: str) -> tuple[Any, Any]:
    """The proxy the environment (HTTPS_PROXY, NO_PROXY, ...) names for this URL: (proxy, auth)."""
    from aiohttp.helpers import get_env_proxy_for_url
    from yarl import URL

    try:
        return get_env_proxy_for_url(URL(url))
    except LookupError:
        return None, None


@contextlib.asynccontextmanager
async def _session() -> AsyncGenerator[Any, None]:
    """The worker's pool (its loop lives as long as the process, and so do its connections); any other
    loop (an `AgentHandle.chat()` caller's, a test's) gets a session of its own for the call."""
    global _pool
    from recovery.process.runtime import owns_running_loop

    if owns_running_loop():
        if _pool is None or _pool.closed:
            _pool = _new_session()
        yield _pool
        return
    async with _new_session() as session:
        yield session


class _Failure(Exception):
    """A failed call, before litellm (loaded then, off the loop) turns it into its own exception."""

    def __init__(self, kind: str, message: str, status: int | None = None, headers: Any = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.status, self.headers = kind, message, status, headers


async def stream(request: LeanRequest) -> AsyncGenerator[Event, None]:
    """Stream one call; provider errors surface as the litellm exceptions litellm would raise (for a call
    chat.turn.plain_openai built, litellm is loaded then, off the loop)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=request.timeout, sock_connect=30)
    try:
        async with (
            _session() as session,
            session.post(
                request.url,
                data=request.body,
                headers=request.headers,
                timeout=timeout,
                proxy=_proxy(request.url)[0],
                proxy_auth=_proxy(request.url)[1],
            ) as response,
        ):
            if response.status != 200:
                await _raise_status(response)
            finished = False
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                for event in _events_of(payload):
                    finished = finished or type(event) is StepFinish
                    yield event
            if not finished:  # neither [DONE] nor a finish reason: the stream was cut short
                raise _mid_stream("the stream ended before its finish reason")
    except (aiohttp.ClientError, ConnectionError) as exc:
        failure = _Failure("APIConnectionError", f"{type(exc).__name__}: {exc}")
        failure.__cause__ = exc
    except TimeoutError as exc:
        failure = _Failure("Timeout", "the provider did not answer in time")
        failure.__cause__ = exc
    except _Failure as raised:
        failure = raised
    else:
        return
    await ensure_litellm()  # one the plain route built did not load it (chat.turn.plain_openai)
    _raise_as_litellm(request, failure)


def _events_of(payload: bytes) -> list[Event]:
    try:
        data = json.loads(payload)
    except ValueError:
        raise _mid_stream(f"a malformed event in the stream: {payload[:200]!r}") from None
    if not isinstance(data, dict):
        raise _mid_stream(f"an event that is not an object: {payload[:200]!r}")
    if data.get("error") is not None:
        error = data["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise _mid_stream(f"the provider reported an error mid-stream: {message}")
    events: list[Event] = []
    for choice in data.get("choices") or ():
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            events.append(ReasoningDelta(str(reasoning)))
        content = delta.get("content")
        if content:
            events.append(TextDelta(str(content)))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            events.append(
                ToolCallDelta(
                    index=call.get("index") or 0,
                    id=call.get("id"),
                    name=function.get("name"),
                    arguments=function.get("arguments") or "",
                )
            )
        if choice.get("finish_reason"):
            events.append(StepFinish(str(choice["finish_reason"])))
    usage = data.get("usage")
    if isinstance(usage, dict) and usage.get("total_tokens"):
        prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        total = usage.get("total_tokens") or prompt + completion
        events.append(Usage(prompt, completion, total, cached if isinstance(cached, int) else 0))
    return events


async def _raise_status(response: Any) -> None:
    body = (await response.content.read(MAX_ERROR_BODY)).decode(errors="replace")
    raise _Failure("status", body, response.status, dict(response.headers))


def _mid_stream(message: str) -> _Failure:
    """A stream broken after it started: what litellm calls a MidStreamFallbackError (transient)."""
    return _Failure("MidStreamFallbackError", message)


def _raise_as_litellm(request: LeanRequest, failure: _Failure) -> None:
    """Raise what litellm raises for this failure: for an HTTP status, what its own mapping gives (a context
    overflow, a rate limit, ...), with the provider's error (and its Retry-After) in the chain."""
    import litellm.exceptions

    if failure.kind != "status":
        error: Exception = getattr(litellm.exceptions, failure.kind)(
            message=failure.message, llm_provider=request.provider, model=request.model
        )
        raise error from failure.__cause__
    import httpx
    from litellm.litellm_core_utils.exception_mapping_utils import exception_type
    from litellm.llms.openai.common_utils import OpenAIError

    provider_error = OpenAIError(
        status_code=failure.status or 500,
        message=failure.message,
        headers=httpx.Headers(failure.headers or {}),
    )
    try:
        raise provider_error from None
    except OpenAIError as raised:
        mapped = exception_type(
            model=request.model, original_exception=raised, custom_llm_provider=request.provider
        )
        raise mapped from raised
