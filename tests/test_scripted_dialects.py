"""The scripted model's Anthropic and Gemini dialects: the wire format each provider documents, read by
litellm's own code path for that provider (chat.turn.llm.stream_chat, as a turn reads a model), and the
errors litellm raises for each classified as a turn classifies them."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import base64  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402
import pytest  # noqa: E402

from chat.turn import llm  # noqa: E402
from chat.turn.errors import default_chat_error_classifier, retry_after_s  # noqa: E402
from think_scripted.dialects import anthropic_messages, gemini_messages  # noqa: E402
from think_scripted.kwargs import litellm_kwargs  # noqa: E402
from think_scripted.server import (  # noqa: E402
    RATE_LIMIT_RETRY_AFTER_S,
    BadRequestError,
    ScriptedModelServer,
    count_prompt_tokens,
    describe_files,
    plan_reply,
)

pytestmark = pytest.mark.timeout(120)

DIALECTS = ["anthropic", "gemini"]
OVERLOADED = {"anthropic": 529, "gemini": 503}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    llm.load_litellm()
    with ScriptedModelServer(token_rate=0) as srv:
        yield srv


async def events(server: ScriptedModelServer, dialect: str, messages: list[Any], **extra: Any) -> list[Any]:
    stream = llm.stream_chat(model=litellm_kwargs(server.url, dialect), messages=messages, **extra)
    return [event async for event in stream]


def text_of(evs: list[Any]) -> str:
    return "".join(e.text for e in evs if isinstance(e, llm.TextDelta))


def calls_of(evs: list[Any]) -> list[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for e in evs:
        if isinstance(e, llm.ToolCallDelta):
            call = calls.setdefault(e.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = e.id or call["id"]
            call["name"] = e.name or call["name"]
            call["arguments"] += e.arguments
    return [calls[i] for i in sorted(calls)]


def finishes(evs: list[Any]) -> list[str]:
    return [e.finish_reason for e in evs if isinstance(e, llm.StepFinish)]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


# -- the requests, turned into chat messages ----------------------------------------------------------


def test_an_anthropic_request_is_read_as_chat_messages() -> None:
    body = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "weather? [tool get_weather]"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sun"}],
                    }
                ],
            },
        ],
    }
    assert anthropic_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather? [tool get_weather]"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sun"},
    ]
    with pytest.raises(BadRequestError, match="role"):
        anthropic_messages({"messages": [{"role": "system", "content": "x"}]})


def test_files_in_each_dialect_are_read_as_the_chat_apis_file_parts() -> None:
    """Anthropic's image and document blocks and Gemini's inline data become image_url and file parts,
    which ``[files]`` describes; a part whose data cannot be read is the request's 400."""
    png, pdf = b"\x89PNG\r\n\x1a\nfake", b"%PDF-1.4 fake"
    b64 = {k: base64.b64encode(v).decode() for k, v in {"png": png, "pdf": pdf}.items()}
    anthropic = anthropic_messages(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "[files]"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": b64["png"]},
                        },
                        {
                            "type": "document",
                            "title": "doc.pdf",
                            "source": {"type": "base64", "media_type": "application/pdf", "data": b64["pdf"]},
                        },
                    ],
                }
            ]
        }
    )
    gemini = gemini_messages(
        {
            "contents": [
                {
                    "role": "user",
                    "parts": [
                        {"text": "[files]"},
                        {"inline_data": {"mime_type": "image/png", "data": b64["png"]}},
                        {"inlineData": {"mimeType": "application/pdf", "data": b64["pdf"]}},
                    ],
                }
            ]
        }
    )
    png_said = f"image/png {len(png)} bytes sha256 {hashlib.sha256(png).hexdigest()[:16]}"
    pdf_said = f"application/pdf {len(pdf)} bytes sha256 {hashlib.sha256(pdf).hexdigest()[:16]}"
    assert describe_files(anthropic[-1]) == f"Files: {png_said}; {pdf_said} named doc.pdf"
    assert describe_files(gemini[-1]) == f"Files: {png_said}; {pdf_said}"
    assert plan_reply(gemini).deltas[0] == {"content": "Files:"}
    assert describe_files({"role": "user", "content": "[files]"}) == "Files: none"
    broken = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}
    with pytest.raises(BadRequestError, match="base64 data URL"):
        describe_files(broken)


def test_gemini_function_responses_answer_the_calls_before_them_in_order() -> None:
    body = {
        "system_instruction": {"parts": [{"text": "Be brief."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "two cities"}]},
            {
                "role": "model",
                "parts": [
                    {"functionCall": {"name": "get_weather", "args": {"city": "A"}}},
                    {"function_call": {"name": "get_weather", "args": {"city": "B"}}},
                ],
            },
            {
                "role": "user",
                "parts": [
                    {"function_response": {"name": "get_weather", "response": {"content": "rain"}}},
                    {"functionResponse": {"name": "get_weather", "response": {"temp": 3}}},
                ],
            },
        ],
    }
    chat = gemini_messages(body)
    assert chat[0] == {"role": "system", "content": "Be brief."}
    ids = [call["id"] for call in chat[2]["tool_calls"]]
    assert ids == ["call_1_0", "call_1_1"]
    assert [(m["tool_call_id"], m["content"]) for m in chat[3:]] == [
        (ids[0], "rain"),
        (ids[1], '{"temp": 3}'),
    ]
    with pytest.raises(BadRequestError, match="contents"):
        gemini_messages({"contents": []})


# -- litellm's read of each dialect ---------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_text_streams_word_by_word_with_usage(server: ScriptedModelServer, dialect: str) -> None:
    messages = [{"role": "system", "content": "s"}, user("count to 7")]
    evs = await events(server, dialect, messages)
    assert text_of(evs) == "1 2 3 4 5 6 7" and len([e for e in evs if isinstance(e, llm.TextDelta)]) == 7
    assert finishes(evs) == ["stop"]
    [usage] = [e for e in evs if isinstance(e, llm.Usage)]
    assert (usage.prompt_tokens, usage.completion_tokens) == (count_prompt_tokens(messages), 7), (
        "the dialect's own usage fields"
    )
    assert server.chats[-1][0] == {"role": "system", "content": "s"}


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_tool_calls_results_and_continuations(server: ScriptedModelServer, dialect: str) -> None:
    prompt = '[tool get_weather {"city": "Oslo"}] [tool get_weather {"city": "Rome"}] count to 2'
    evs = await events(server, dialect, [user(prompt)], tools=TOOLS)
    calls = calls_of(evs)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert finishes(evs) == ["tool_calls"] and all(c["id"] for c in calls)
    history = [
        user(prompt),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ],
        },
        *(
            {"role": "tool", "tool_call_id": c["id"], "content": r}
            for c, r in zip(calls, ["sun", "rain"], strict=True)
        ),
    ]
    answer = await events(server, dialect, history, tools=TOOLS)
    assert text_of(answer) == "Tool get_weather returned: sun; Tool get_weather returned: rain 1 2"
    resumed = await events(server, dialect, [user("count to 6"), {"role": "assistant", "content": "1 2 3"}])
    assert text_of(resumed) == " 4 5 6"


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_call_that_does_not_stream_gets_the_whole_reply(
    server: ScriptedModelServer, dialect: str
) -> None:
    model = litellm_kwargs(server.url, dialect)
    summary = [{"role": "system", "content": "Summarize the conversation below."}, user("a\nb\nc")]
    assert await llm.complete_text(model=model, messages=summary) == "Summary of 3 lines."
    import litellm

    response = await litellm.acompletion(
        messages=[user('[tool get_weather {"city": "Oslo"}]')], tools=TOOLS, num_retries=0, **model
    )
    [call] = response.choices[0].message.tool_calls
    assert (
        json.loads(call.function.arguments) == {"city": "Oslo"}
        and response.choices[0].finish_reason == "tool_calls"
    )


def classified(dialect: str, directive: str) -> str:
    return directive.replace("OVERLOADED", str(OVERLOADED[dialect]))


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize(
    ("directive", "kind"),
    [
        ("[overflow]", "context_overflow"),
        ("[window 5] a longer prompt than five tokens", "context_overflow"),
        ("[fail after 0 with 429]", "rate_limit"),
        ("[fail after 0 with OVERLOADED]", "transient"),
        ("[fail after 3 with OVERLOADED]", "transient"),
        ("[fail after 0 with 500]", "transient"),
        ("[reset after 3]", "transient"),
        ("[fail after 0 with 400]", None),
        ("[fail after 0 with 401]", None),
    ],
)
async def test_errors_are_classified_as_a_turn_needs(
    server: ScriptedModelServer, dialect: str, directive: str, kind: str | None
) -> None:
    with pytest.raises(Exception) as raised:
        await asyncio.wait_for(
            events(server, dialect, [user(f"count to 5 {classified(dialect, directive)}")]), 10
        )
    assert default_chat_error_classifier(raised.value) == kind


async def test_an_anthropic_rate_limit_keeps_its_retry_after(server: ScriptedModelServer) -> None:
    with pytest.raises(Exception) as raised:
        await events(server, "anthropic", [user("count to 5 [fail after 0 with 429]")])
    assert retry_after_s(raised.value) == RATE_LIMIT_RETRY_AFTER_S


# -- the wire format, as the providers document it ----------------------------------------------------


async def raw(server: ScriptedModelServer, path: str, body: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """The server-sent events of one response: (event name, data) each."""
    root = server.url.removesuffix("/v1")
    async with aiohttp.ClientSession() as session, session.post(root + path, json=body) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        text = await response.text()
    out = []
    for block in filter(None, text.split("\n\n")):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


async def test_the_anthropic_event_sequence(server: ScriptedModelServer) -> None:
    body = {"model": "claude-x", "max_tokens": 100, "stream": True}
    text = await raw(server, "/v1/messages", {**body, "messages": [user("count to 2")]})
    assert [name for name, _ in text] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(name == data["type"] for name, data in text)
    assert text[0][1]["message"]["usage"]["input_tokens"] == count_prompt_tokens([user("count to 2")])
    assert text[3][1]["delta"] == {"type": "text_delta", "text": "1"}
    assert text[6][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 2},
    }
    tool = await raw(
        server, "/v1/messages", {**body, "messages": [user('[tool get_weather {"city": "Oslo"}]')]}
    )
    start = next(data for name, data in tool if name == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "get_weather"
    pieces = [data["delta"]["partial_json"] for name, data in tool if name == "content_block_delta"]
    assert json.loads("".join(pieces)) == {"city": "Oslo"} and len(pieces) == 3
    assert next(d for n, d in tool if n == "message_delta")["delta"]["stop_reason"] == "tool_use"
    unfinished = await raw(server, "/v1/messages", {**body, "messages": [user("count to 2 [no finish]")]})
    assert [name for name, _ in unfinished][-2:] == ["content_block_stop", "message_stop"]


async def test_the_gemini_responses(server: ScriptedModelServer) -> None:
    path = "/v1beta/models/gemini-x:streamGenerateContent?alt=sse"
    text = await raw(server, path, {"contents": [{"role": "user", "parts": [{"text": "count to 2"}]}]})
    assert [d["candidates"][0]["content"]["parts"] for _, d in text] == [
        [{"text": "1"}],
        [{"text": " 2"}],
        [{"text": ""}],
    ]
    assert [d["candidates"][0].get("finishReason") for _, d in text] == [None, None, "STOP"]
    assert text[-1][1]["usageMetadata"] == {
        "promptTokenCount": 7,
        "candidatesTokenCount": 2,
        "totalTokenCount": 9,
    }
    prompt = '[tool get_weather {"city": "Oslo"}]'
    tool = await raw(server, path, {"contents": [{"role": "user", "parts": [{"text": prompt}]}]})
    assert tool[0][1]["candidates"][0]["content"]["parts"] == [
        {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}
    ], "a function call comes whole"
    unfinished = await raw(
        server, path, {"contents": [{"role": "user", "parts": [{"text": "count to 2 [no finish]"}]}]}
    )
    assert all("finishReason" not in d["candidates"][0] for _, d in unfinished)


@pytest.mark.parametrize(
    ("path", "status", "body"),
    [
        (
            "/v1/messages",
            400,
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "prompt is too long: 130000 tokens > 128000 maximum",
                },
            },
        ),
        (
            "/v1beta/models/g:generateContent",
            400,
            {
                "error": {
                    "code": 400,
                    "message": "The input token count (130000) exceeds the maximum number of tokens allowed"
                    " (128000).",
                    "status": "INVALID_ARGUMENT",
                }
            },
        ),
    ],
)
async def test_an_overflow_is_the_providers_own_error(
    server: ScriptedModelServer, path: str, status: int, body: dict[str, Any]
) -> None:
    root = server.url.removesuffix("/v1")
    request = (
        {"messages": [user("[overflow]")], "max_tokens": 10}
        if path == "/v1/messages"
        else {"contents": [{"role": "user", "parts": [{"text": "[overflow]"}]}]}
    )
    async with aiohttp.ClientSession() as session, session.post(root + path, json=request) as response:
        assert response.status == status and await response.json() == body
