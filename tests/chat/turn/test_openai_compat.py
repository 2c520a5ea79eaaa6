"""The lean read of OpenAI-compatible streams (chat.turn.openai_compat) against litellm's own read.

Both paths stream the same scripted-model responses; the events they produce, the errors they raise
and how those errors are classified must be the same.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from chat.turn import llm, openai_compat  # noqa: E402
from chat.turn.errors import default_chat_error_classifier, retry_after_s  # noqa: E402
from think_scripted.server import RATE_LIMIT_RETRY_AFTER_S, ScriptedModelServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    llm.load_litellm()
    with ScriptedModelServer(token_rate=0) as srv:
        yield srv


def scripted(server: ScriptedModelServer) -> dict[str, Any]:
    return {"model": "openai/scripted", "api_base": server.url, "api_key": "sk-scripted"}


async def events(server: ScriptedModelServer, prompt: str, *, lean: bool, **extra: Any) -> list[Any]:
    messages = [{"role": "user", "content": prompt}]
    stream = llm.stream_chat(model=scripted(server), messages=messages, lean=lean, **extra)
    return [event async for event in stream]


async def failure(server: ScriptedModelServer, prompt: str, *, lean: bool) -> BaseException:
    with pytest.raises(Exception) as raised:
        await asyncio.wait_for(events(server, prompt, lean=lean), 10)
    return raised.value


def unnumbered(event: Any) -> Any:
    """The scripted model numbers its tool calls by request: compare calls without their ids."""
    return (
        dataclasses.replace(event, id="call") if isinstance(event, llm.ToolCallDelta) and event.id else event
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize(
    ("prompt", "extra"),
    [
        ("count to 12", {}),
        ("hello there", {}),
        ('[tool get_weather {"city": "Oslo"}] [tool get_weather {"city": "Rome"}]', {"tools": TOOLS}),
    ],
)
async def test_the_lean_read_yields_what_litellm_yields(
    server: ScriptedModelServer, prompt: str, extra: dict[str, Any]
) -> None:
    lean = await events(server, prompt, lean=True, **extra)
    through_litellm = await events(server, prompt, lean=False, **extra)
    assert [unnumbered(e) for e in lean] == [unnumbered(e) for e in through_litellm]
    assert isinstance(lean[-1], llm.Usage) and lean[-1].total_tokens > 0
    assert server.clients[-2].startswith("Python") and "aiohttp" in server.clients[-2]
    assert "OpenAI" in server.clients[-1], "lean=False reads through litellm (the OpenAI SDK)"


async def test_litellm_builds_the_request(server: ScriptedModelServer) -> None:
    await events(server, "count to 2", lean=True, temperature=0.25, tools=TOOLS)
    body = server.requests[-1]
    assert body["model"] == "scripted" and body["temperature"] == 0.25 and body["tools"] == TOOLS
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "extra_body" not in body


@pytest.mark.parametrize(
    "directive",
    [
        "[fail after 0 with 429]",
        "[fail after 0 with 500]",
        "[fail after 0 with 503]",
        "[fail after 3 with 500]",
        "[fail after 3 with 429]",
        "[malformed after 0]",
        "[malformed after 3]",
        "[reset after 0]",
        "[reset after 3]",
        "[eof after 0]",
        "[eof after 3]",
        "[fail after 0 with 400]",
        "[fail after 0 with 401]",
        "[fail after 0 with 404]",
        "[overflow]",
    ],
)
async def test_errors_are_classified_as_on_litellms_path(server: ScriptedModelServer, directive: str) -> None:
    lean = await failure(server, f"count to 5 {directive}", lean=True)
    through_litellm = await failure(server, f"count to 5 {directive}", lean=False)
    assert default_chat_error_classifier(lean) == default_chat_error_classifier(through_litellm)
    assert retry_after_s(lean) == retry_after_s(through_litellm)


async def test_a_rate_limit_keeps_its_retry_after(server: ScriptedModelServer) -> None:
    error = await failure(server, "count to 5 [fail after 0 with 429]", lean=True)
    assert default_chat_error_classifier(error) == "rate_limit"
    assert retry_after_s(error) == RATE_LIMIT_RETRY_AFTER_S


async def test_an_overflow_is_litellms_context_window_error(server: ScriptedModelServer) -> None:
    import litellm

    error = await failure(server, "count to 5 [window 3] " + "word " * 20, lean=True)
    assert isinstance(error, litellm.ContextWindowExceededError)
    assert default_chat_error_classifier(error) == "context_overflow"


@pytest.mark.parametrize(
    "model",
    ["anthropic/claude-sonnet-4-5", "gemini/gemini-2.5-flash", "azure/gpt-4o", "ollama_chat/llama3"],
)
def test_other_providers_are_read_by_litellm(model: str) -> None:
    llm.load_litellm()
    assert openai_compat.lean_request({"model": model}, [{"role": "user", "content": "hi"}]) is None


def test_openai_without_a_base_url_goes_to_openai(monkeypatch: pytest.MonkeyPatch) -> None:
    llm.load_litellm()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_BASE", raising=False)
    request = openai_compat.lean_request({"model": "openai/gpt-4o-mini"}, [{"role": "user", "content": "hi"}])
    assert request is not None and request.url == "https://api.openai.com/v1/chat/completions"
    assert request.headers["Authorization"] == "Bearer sk-from-env"
    assert json.loads(request.body)["model"] == "gpt-4o-mini"
