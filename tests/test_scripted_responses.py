"""The scripted model's Responses API (background mode, resumable event streams), through the real clients:
litellm's ``aresponses`` / ``aget_responses`` and the ``openai`` package's ``AsyncOpenAI().responses``.

No database is needed: the server runs in a background thread (ScriptedModelServer).
"""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncIterator, Callable, Iterator  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402
import litellm  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from litellm.exceptions import MidStreamFallbackError  # noqa: E402
from litellm.responses.utils import ResponsesAPIRequestUtils  # noqa: E402
from litellm.utils import supports_native_streaming  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from chat.turn.llm import load_litellm  # noqa: E402
from think_scripted.responses import RESPONSES_KEY, input_messages  # noqa: E402
from think_scripted.server import ScriptedModelServer  # noqa: E402

litellm.suppress_debug_info = True

TIMEOUT = 10.0  # bound on every wait that is expected to succeed
MODEL = "openai/scripted"
EVENT = TypeAdapter(ResponseStreamEvent)

pytestmark = [
    pytest.mark.timeout(120),
    # litellm's own success logging dumps a chat-style usage dict through its ResponseAPIUsage field
    pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer(token_rate=0) as srv:
        yield srv


@pytest.fixture(scope="module", autouse=True)
def native_streaming() -> None:
    """litellm 1.110.2 fakes the stream of a model it has no cost-map entry for (supports_native_streaming
    is False when the lookup fails): it POSTs without ``stream`` and wraps the reply, which for a
    background request is the *queued* response. The demo settings name the scripted model in
    THINK["LITELLM_MODELS"], which chat.turn.llm registers when it loads litellm: that makes the stream
    real; these tests use that registration."""
    load_litellm()
    assert supports_native_streaming(MODEL, "openai")


@pytest.fixture
def client(server: ScriptedModelServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key="sk-x", max_retries=0)


def litellm_kwargs(server: ScriptedModelServer) -> dict[str, Any]:
    return {"api_base": server.url, "api_key": "sk-x"}


def provider_id(litellm_id: str) -> str:
    """The server's own id inside the id litellm hands out (base64 of provider, model id and response id)."""
    decoded = ResponsesAPIRequestUtils.decode_responses_api_response_id(litellm_id)
    assert decoded["custom_llm_provider"] == "openai"
    return str(decoded["response_id"])


def count_text(n: int) -> str:
    return " ".join(str(i) for i in range(1, n + 1))


def stored_events(server: ScriptedModelServer, response_id: str) -> list[dict[str, Any]]:
    return list(server.app[RESPONSES_KEY].responses[response_id].events)


async def until(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def read_deltas(events: AsyncIterator[Any], k: int) -> list[Any]:
    """The events up to and including the k-th text delta."""
    seen: list[Any] = []
    async for event in events:
        seen.append(event)
        if sum(e.type == "response.output_text.delta" for e in seen) == k:
            break
    return seen


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def assert_contiguous(events: list[Any]) -> None:
    """Sequence numbers 0, 1, 2, ... without a gap or a duplicate."""
    assert [e.sequence_number for e in events] == list(range(len(events)))


# --- litellm ---------------------------------------------------------------------------------------------


async def test_litellm_resume_after_disconnect_gets_exactly_the_rest(server: ScriptedModelServer) -> None:
    created = server.responses_created
    stream = await litellm.aresponses(
        model=MODEL, input="count to 40 [rate 40]", background=True, stream=True, **litellm_kwargs(server)
    )
    first = await read_deltas(stream, 5)
    await stream.aclose()  # the client goes away after 5 numbers
    litellm_id = first[0].response.id
    assert litellm_id.startswith("resp_") and litellm_id != provider_id(litellm_id)  # re-encoded by litellm
    raw_id = provider_id(litellm_id)
    assert raw_id.startswith("resp_scripted_")
    assert text_of(first) == count_text(5)
    await until(lambda: server.response_output_tokens[raw_id] >= 10)  # it carries on without the client

    last = first[-1].sequence_number
    resumed = await litellm.aget_responses(
        response_id=litellm_id, stream=True, starting_after=last, **litellm_kwargs(server)
    )
    rest = [event async for event in resumed]
    assert rest[0].sequence_number == last + 1
    assert_contiguous(first + rest)
    assert rest[-1].type == "response.completed"
    assert text_of(first) + text_of(rest) == count_text(40)

    stored = await litellm.aget_responses(response_id=litellm_id, **litellm_kwargs(server))
    assert stored.status == "completed"
    assert stored.output[0].content[0].text == count_text(40)
    assert server.responses_created == created + 1  # one generation billed
    assert server.response_output_tokens[raw_id] == 40


async def test_litellm_resume_with_the_provider_id(server: ScriptedModelServer) -> None:
    stream = await litellm.aresponses(
        model=MODEL, input="count to 12 [rate 50]", background=True, stream=True, **litellm_kwargs(server)
    )
    first = await read_deltas(stream, 2)
    await stream.aclose()
    raw_id = provider_id(first[0].response.id)
    resumed = await litellm.aget_responses(
        response_id=raw_id,
        custom_llm_provider="openai",  # a bare provider id names no provider
        stream=True,
        starting_after=first[-1].sequence_number,
        **litellm_kwargs(server),
    )
    rest = [event async for event in resumed]
    assert text_of(first + rest) == count_text(12)
    assert_contiguous(first + rest)


async def test_litellm_function_calls_resumed_mid_call(server: ScriptedModelServer) -> None:
    prompt = 'weather please [tool get_weather {"city": "Paris"}] [tool get_time {}] [rate 30]'
    stream = await litellm.aresponses(
        model=MODEL, input=prompt, background=True, stream=True, **litellm_kwargs(server)
    )
    first: list[Any] = []
    async for event in stream:
        first.append(event)
        if event.type == "response.function_call_arguments.delta":
            break
    await stream.aclose()
    resumed = await litellm.aget_responses(
        response_id=first[0].response.id,
        stream=True,
        starting_after=first[-1].sequence_number,
        **litellm_kwargs(server),
    )
    events = first + [event async for event in resumed]
    assert_contiguous(events)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.name, i.arguments) for i in added] == [
        ("function_call", "get_weather", ""),
        ("function_call", "get_time", ""),
    ]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    calls = [(o.name, json.loads(o.arguments), o.call_id) for o in final.output]
    serial = provider_id(final.id).rsplit("_", 1)[1]
    assert calls == [
        ("get_weather", {"city": "Paris"}, f"call_{serial}_0"),
        ("get_time", {}, f"call_{serial}_1"),
    ]


async def test_litellm_forgotten_response_is_a_404(server: ScriptedModelServer) -> None:
    stream = await litellm.aresponses(
        model=MODEL, input="count to 4 [forget]", background=True, stream=True, **litellm_kwargs(server)
    )
    events = [event async for event in stream]
    assert text_of(events) == count_text(4)  # the POST's own stream is whole
    litellm_id = events[0].response.id
    with pytest.raises(litellm.NotFoundError) as caught:
        await litellm.aget_responses(
            response_id=litellm_id, stream=True, starting_after=3, **litellm_kwargs(server)
        )
    assert caught.value.status_code == 404
    assert isinstance(caught.value, openai.NotFoundError)
    with pytest.raises(litellm.NotFoundError):
        await litellm.aget_responses(response_id=litellm_id, **litellm_kwargs(server))
    assert server.response_output_tokens[provider_id(litellm_id)] == 4


async def test_litellm_failed_response_raises_mid_stream(server: ScriptedModelServer) -> None:
    stream = await litellm.aresponses(
        model=MODEL,
        input="count to 6 [fail after 3 with 500]",
        background=True,
        stream=True,
        **litellm_kwargs(server),
    )
    seen: list[Any] = []
    with pytest.raises(MidStreamFallbackError):
        async for event in stream:
            seen.append(event)
    assert text_of(seen) == count_text(3)
    stored = await litellm.aget_responses(response_id=seen[0].response.id, **litellm_kwargs(server))
    assert stored.status == "failed"


async def test_litellm_without_background(server: ScriptedModelServer) -> None:
    stream = await litellm.aresponses(model=MODEL, input="count to 3", stream=True, **litellm_kwargs(server))
    events = [event async for event in stream]
    assert_contiguous(events)
    assert text_of(events) == count_text(3)
    whole = await litellm.aresponses(model=MODEL, input="count to 3", **litellm_kwargs(server))
    assert whole.status == "completed"
    assert whole.output[0].content[0].text == count_text(3)


# --- openai ----------------------------------------------------------------------------------------------


async def test_openai_resume_after_disconnect_gets_exactly_the_rest(
    server: ScriptedModelServer, client: openai.AsyncOpenAI
) -> None:
    created = server.responses_created
    stream = await client.responses.create(
        model="scripted", input="count to 40 [rate 40]", background=True, stream=True
    )
    first = await read_deltas(stream, 7)
    await stream.close()
    response_id = first[0].response.id  # the provider's id, as is
    assert first[0].response.status == "queued"
    await until(lambda: server.response_output_tokens[response_id] >= 12)

    resumed = await client.responses.retrieve(
        response_id, stream=True, starting_after=first[-1].sequence_number
    )
    rest = [event async for event in resumed]
    assert_contiguous(first + rest)
    assert text_of(first) + text_of(rest) == count_text(40)
    stored = await client.responses.retrieve(response_id)
    assert stored.status == "completed"
    assert stored.output_text == text_of(first) + text_of(rest)
    assert stored.usage is not None and stored.usage.output_tokens == 40
    assert server.responses_created == created + 1
    assert server.response_output_tokens[response_id] == 40


async def test_openai_event_sequence_and_types(
    server: ScriptedModelServer, client: openai.AsyncOpenAI
) -> None:
    stream = await client.responses.create(model="scripted", input="count to 3", background=True, stream=True)
    events = [event async for event in stream]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["1", " 2", " 3"]
    response_id = events[0].response.id
    for raw in stored_events(server, response_id):  # every field the openai types require, strictly
        EVENT.validate_python(raw)
    completed = events[-1].response
    Response.model_validate(completed.model_dump())
    assert (completed.status, completed.output_text) == ("completed", "1 2 3")
    assert completed.usage is not None
    assert completed.usage.total_tokens == completed.usage.input_tokens + completed.usage.output_tokens


async def test_openai_get_while_in_progress_then_cancel(
    server: ScriptedModelServer, client: openai.AsyncOpenAI
) -> None:
    queued = await client.responses.create(model="scripted", input="count to 500 [rate 25]", background=True)
    assert queued.status == "queued"
    await until(lambda: server.response_output_tokens[queued.id] >= 3)
    now = await client.responses.retrieve(queued.id)
    assert now.status == "in_progress"
    assert now.usage is None
    assert count_text(500).startswith(now.output_text) and len(now.output_text.split()) >= 3

    follower = await client.responses.retrieve(queued.id, stream=True, starting_after=0)
    cancelled = await client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    events = [event async for event in follower]  # the live tail ends, without a terminal event
    assert events[0].sequence_number == 1
    assert events[-1].type == "response.output_text.delta"
    tokens = server.response_output_tokens[queued.id]
    await asyncio.sleep(0.2)
    assert server.response_output_tokens[queued.id] == tokens < 500
    assert (await client.responses.retrieve(queued.id)).status == "cancelled"


async def test_openai_stall_holds_the_response_in_progress(
    server: ScriptedModelServer, client: openai.AsyncOpenAI
) -> None:
    queued = await client.responses.create(
        model="scripted", input="count to 9 [stall after 4]", background=True
    )
    await until(lambda: server.response_output_tokens[queued.id] == 4)
    await asyncio.sleep(0.2)
    stalled = await client.responses.retrieve(queued.id)
    assert (stalled.status, stalled.output_text) == ("in_progress", count_text(4))
    await client.responses.cancel(queued.id)


async def test_openai_function_calls_and_tool_results(
    server: ScriptedModelServer, client: openai.AsyncOpenAI
) -> None:
    prompt = 'weather please [tool get_weather {"city": "Paris"}] [tool get_time {}]'
    stream = await client.responses.create(
        model="scripted",
        input=prompt,
        tools=[
            {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": False}
        ],
        background=True,
        stream=True,
    )
    events = [event async for event in stream]
    assert_contiguous(events)
    first = next(e for e in events if e.type == "response.output_item.added")
    assert first.item.type == "function_call"
    assert (first.item.name, first.item.arguments) == ("get_weather", "")
    assert first.item.id and first.item.call_id
    pieces = [
        e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == 0
    ]
    assert len(pieces) == 3 and "".join(pieces) == '{"city": "Paris"}'
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == ['{"city": "Paris"}', "{}"]
    for raw in stored_events(server, events[0].response.id):
        EVENT.validate_python(raw)
    calls = events[-1].response.output
    assert [c.type for c in calls] == ["function_call", "function_call"]

    follow_up: list[Any] = [{"role": "user", "content": prompt}]
    follow_up += [
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
        for c in calls
    ]
    follow_up += [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        {"type": "function_call_output", "call_id": calls[1].call_id, "output": "noon"},
    ]
    answer = await client.responses.create(model="scripted", input=follow_up)
    assert answer.output_text == "Tool get_weather returned: sunny; Tool get_time returned: noon"


async def test_openai_forgotten_response_is_a_404(
    server: ScriptedModelServer, client: openai.AsyncOpenAI
) -> None:
    stream = await client.responses.create(
        model="scripted", input="count to 4 [forget]", background=True, stream=True
    )
    events = [event async for event in stream]
    assert text_of(events) == count_text(4)
    response_id = events[0].response.id
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.retrieve(response_id, stream=True, starting_after=2)
    assert caught.value.status_code == 404
    assert caught.value.body == {
        "message": f"Response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response_id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel(response_id)


async def test_openai_reset_mid_stream_then_resume(
    server: ScriptedModelServer, client: openai.AsyncOpenAI
) -> None:
    """The POST's connection breaks (as a provider's or proxy's would); the generation carries on."""
    stream = await client.responses.create(
        model="scripted", input="count to 20 [reset after 6] [rate 100]", background=True, stream=True
    )
    first: list[Any] = []
    with pytest.raises(openai.APIConnectionError):
        async for event in stream:
            first.append(event)
    assert text_of(first) == count_text(6)
    resumed = await client.responses.retrieve(
        first[0].response.id, stream=True, starting_after=first[-1].sequence_number
    )
    rest = [event async for event in resumed]  # a resume is never broken
    assert_contiguous(first + rest)
    assert text_of(first + rest) == count_text(20)


async def test_openai_failure_after_k(server: ScriptedModelServer, client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(
        model="scripted", input="count to 6 [fail after 3 with 429]", background=True, stream=True
    )
    events = [event async for event in stream]
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    assert events[-1].response.error is not None and events[-1].response.error.code == "rate_limit_exceeded"
    assert text_of(events) == count_text(3)


async def test_openai_without_background(server: ScriptedModelServer, client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model="scripted", input="count to 300 [rate 100]", stream=True)
    first = await read_deltas(stream, 2)
    await stream.close()  # not a background response: leaving cancels it
    response_id = first[0].response.id
    await until(lambda: server.app[RESPONSES_KEY].responses[response_id].status == "cancelled")
    assert server.response_output_tokens[response_id] < 300

    whole = await client.responses.create(
        model="scripted", instructions="Be brief.", input=[{"role": "user", "content": "count to 5"}]
    )
    assert (whole.status, whole.output_text, whole.instructions) == ("completed", count_text(5), "Be brief.")
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        await client.responses.cancel(whole.id)


async def test_openai_early_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await client.responses.create(model="scripted", input="[overflow]", background=True, stream=True)
    with pytest.raises(openai.InternalServerError):
        await client.responses.create(model="scripted", input="hi [fail after 0 with 503]", background=True)
    with pytest.raises(openai.BadRequestError, match="store"):
        await client.responses.create(model="scripted", input="hi", background=True, store=False)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await client.responses.create(model="scripted", input="hi", previous_response_id="resp_x")


# --- the server on its own -------------------------------------------------------------------------------


async def test_one_server_serves_both_apis(server: ScriptedModelServer) -> None:
    async with aiohttp.ClientSession() as http:
        chat = await http.post(
            f"{server.url}/chat/completions", json={"messages": [{"role": "user", "content": "count to 2"}]}
        )
        assert (await chat.json())["choices"][0]["message"]["content"] == "1 2"
        bad = await http.post(f"{server.url}/responses", json={"input": 3})
        assert bad.status == 400 and (await bad.json())["error"]["type"] == "invalid_request_error"
        missing = await http.get(f"{server.url}/responses/resp_nope", params={"stream": "true"})
        assert missing.status == 404


def test_input_messages() -> None:
    assert input_messages({"input": "hi", "instructions": "sys"}) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "count to 3"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "1 2"}]},
        {"type": "function_call", "call_id": "c0", "name": "a", "arguments": "{}"},
        {"type": "function_call", "call_id": "c1", "name": "b", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c0", "output": "x"},
        {"type": "reasoning", "summary": []},
    ]
    assert input_messages({"input": items}) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "count to 3"},
        {"role": "assistant", "content": "1 2"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "a", "arguments": "{}"}},
                {"id": "c1", "type": "function", "function": {"name": "b", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "x"},
    ]
