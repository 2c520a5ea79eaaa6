"""The scripted OpenAI-compatible model server, exercised through litellm's real OpenAI code path.

No database is needed: the server runs in a background thread (ScriptedModelServer).
"""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402
import litellm  # noqa: E402
import pytest  # noqa: E402
from litellm.exceptions import MidStreamFallbackError  # noqa: E402

from think_scripted.server import (  # noqa: E402
    DEFAULT_TOKEN_RATE,
    FIXED_REPLY,
    OVERFLOW_MESSAGE,
    RATE_LIMIT_RETRY_AFTER_S,
    STATE_KEY,
    SUMMARY_MARKER,
    BadRequestError,
    Directives,
    Fault,
    Plan,
    ScriptedModelServer,
    build_app,
    count_prompt_tokens,
    parse_directives,
    plan_reply,
)

litellm.suppress_debug_info = True

TIMEOUT = 10.0  # bound on every wait that is expected to succeed

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer(token_rate=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def slow_server() -> Iterator[ScriptedModelServer]:
    """Paced at one chunk per 5 s unless a request overrides it."""
    with ScriptedModelServer(token_rate=0.2) as srv:
        yield srv


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@dataclass
class Streamed:
    deltas: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    tool_calls: list[Any] = field(default_factory=list)
    usage: Any = None
    chunks: list[Any] = field(default_factory=list)

    def message(self) -> Any:
        """The assistant message litellm assembles from the chunks."""
        return litellm.stream_chunk_builder(self.chunks).choices[0].message


async def open_stream(server: ScriptedModelServer, messages: list[dict[str, Any]]) -> Any:
    call = litellm.acompletion(
        model="openai/scripted",
        api_base=server.url,
        api_key="sk-scripted",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        num_retries=0,
    )
    return await asyncio.wait_for(call, TIMEOUT)


def record(chunk: Any, into: Streamed) -> None:
    into.chunks.append(chunk)
    if getattr(chunk, "usage", None) is not None:
        into.usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.content:
            into.deltas.append(choice.delta.content)
        into.tool_calls.extend(choice.delta.tool_calls or [])
        if choice.finish_reason:
            into.finish_reasons.append(choice.finish_reason)


async def stream(
    server: ScriptedModelServer, messages: list[dict[str, Any]], into: Streamed | None = None
) -> Streamed:
    """Run a streamed completion to its end; chunks land in ``into`` (if given) as they arrive."""
    result = into if into is not None else Streamed()
    response = await open_stream(server, messages)

    async def drain() -> None:
        async for chunk in response:
            record(chunk, result)

    await asyncio.wait_for(drain(), TIMEOUT)
    return result


async def complete(server: ScriptedModelServer, messages: list[dict[str, Any]]) -> Any:
    call = litellm.acompletion(
        model="openai/scripted", api_base=server.url, api_key="sk-scripted", messages=messages, num_retries=0
    )
    return await asyncio.wait_for(call, TIMEOUT)


async def wait_until_idle(server: ScriptedModelServer) -> None:
    async def poll() -> None:
        while server.in_flight:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), TIMEOUT)


async def raw_post(server: ScriptedModelServer, body: Any) -> tuple[int, str]:
    data = body if isinstance(body, str) else json.dumps(body)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        headers = {"Content-Type": "application/json"}
        async with session.post(f"{server.url}/chat/completions", data=data, headers=headers) as resp:
            return resp.status, await resp.text()


def call_message(calls: list[Any]) -> dict[str, Any]:
    """The assistant message a client sends back for these tool calls (litellm objects or plain dicts)."""
    plain = [call if isinstance(call, dict) else call.model_dump() for call in calls]
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": c["id"],
                "type": "function",
                "function": {k: c["function"][k] for k in ("name", "arguments")},
            }
            for c in plain
        ],
    }


def tool_result(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def planned_calls(plan: Plan) -> list[dict[str, Any]]:
    """The tool calls of a plan as the non-streaming message lists them."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in plan.deltas:
        for piece in delta["tool_calls"]:
            call = calls.setdefault(piece["index"], {"id": None, "function": {"name": None, "arguments": ""}})
            call["id"] = piece.get("id", call["id"])
            call["function"]["name"] = piece["function"].get("name", call["function"]["name"])
            call["function"]["arguments"] += piece["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def planned_text(plan: Plan) -> str:
    assert plan.finish_reason == "stop"
    return "".join(delta["content"] for delta in plan.deltas)


def sse_payloads(text: str) -> list[str]:
    events = [event for event in text.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events), events
    return [event.removeprefix("data: ") for event in events]


# --- counting and text replies through litellm ---------------------------------------------------


async def test_count_to_five_streams_one_number_per_chunk_with_usage(server: ScriptedModelServer) -> None:
    result = await stream(server, [user("Please count to 5.")])

    assert result.deltas == ["1", " 2", " 3", " 4", " 5"]
    assert result.finish_reasons == ["stop"]
    assert result.usage.prompt_tokens > 0
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5


async def test_count_accepts_openai_content_parts(server: ScriptedModelServer) -> None:
    parts = [{"type": "text", "text": "COUNT TO"}, {"type": "text", "text": " 3"}]
    result = await stream(server, [{"role": "user", "content": parts}])

    assert result.deltas == ["1", " 2", " 3"]


async def test_non_streaming_count(server: ScriptedModelServer) -> None:
    response = await complete(server, [{"role": "system", "content": "Be brief."}, user("count to 4")])

    assert response.choices[0].message.content == "1 2 3 4"
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == 4
    assert response.usage.prompt_tokens > 0


async def test_fixed_reply_is_streamed_word_by_word(server: ScriptedModelServer) -> None:
    result = await stream(server, [user("Hi there")])

    assert "".join(result.deltas) == FIXED_REPLY
    assert len(result.deltas) == len(FIXED_REPLY.split())
    assert result.deltas[0] == "Hello!"
    assert all(delta.startswith(" ") for delta in result.deltas[1:])
    assert result.usage.completion_tokens == len(result.deltas)


# --- continuations -------------------------------------------------------------------------------


async def test_continuation_after_assistant_message(server: ScriptedModelServer) -> None:
    result = await stream(server, [user("count to 6"), assistant("1 2 3")])

    assert result.deltas == [" 4", " 5", " 6"]
    assert result.finish_reasons == ["stop"]
    assert server.requests[-1]["messages"][-1] == assistant("1 2 3")


async def test_continuation_with_continue_prompt(server: ScriptedModelServer) -> None:
    messages = [
        user("count to 6"),
        assistant("1 2 3 4"),
        user("Continue your previous response exactly where it stopped, without repeating anything."),
    ]
    result = await stream(server, messages)

    assert result.deltas == [" 5", " 6"]


async def test_a_continuations_habits_repeat_and_restart(server: ScriptedModelServer) -> None:
    """[repeat N] and [restart] imitate what real models do when asked to continue (issue 39): the
    last N words again, the sentence they were in again, or the whole answer again, glued on."""
    from think_scripted.server import STORY

    sent = " ".join(STORY.split()[:12])  # "... It mixed paints at night" (the second sentence cut off)
    cont = user("Continue your previous response exactly where it stopped.")
    rest = STORY.split()[12:]
    repeat = await stream(server, [user("[story] [repeat 3]"), assistant(sent), cont])
    assert "".join(repeat.deltas).split() == STORY.split()[9:]
    restart = await stream(server, [user("[story] [restart]"), assistant(sent), cont])
    assert "".join(restart.deltas) == " " + " ".join(STORY.split()[7:])  # "It mixed paints ..."
    whole = await stream(server, [user("[story] [restart all]"), assistant(sent), cont])
    assert "".join(whole.deltas) == STORY  # from the top, no space before it
    plain = await stream(server, [user("[story]"), assistant(sent), cont])
    assert "".join(plain.deltas).split() == rest
    counted = await stream(server, [user("count to 8 [repeat 2]"), assistant("1 2 3 4"), cont])
    assert counted.deltas == [" 3", " 4", " 5", " 6", " 7", " 8"]


async def test_continuation_already_at_n_only_stops(server: ScriptedModelServer) -> None:
    result = await stream(server, [user("count to 3"), assistant("1 2 3")])

    assert result.deltas == []
    assert result.finish_reasons == ["stop"]
    assert result.usage.completion_tokens == 0


async def test_continuation_of_fixed_reply_skips_words_already_sent(server: ScriptedModelServer) -> None:
    result = await stream(server, [user("Hi"), assistant("Hello! I am")])

    assert result.deltas[0] == " the"
    assert "Hello! I am" + "".join(result.deltas) == FIXED_REPLY


@pytest.mark.parametrize(
    "directive",
    ["[stall after 1]", "[fail after 0 with 500]", "[overflow]", "[malformed after 1]", "[reset after 0]"],
)
async def test_continuation_does_not_reapply_one_shot_faults(
    server: ScriptedModelServer, directive: str
) -> None:
    result = await stream(server, [user(f"count to 4 {directive}"), assistant("1 2")])

    assert result.deltas == [" 3", " 4"]
    assert result.finish_reasons == ["stop"]


async def test_stall_always_applies_to_each_continuation(server: ScriptedModelServer) -> None:
    response = await open_stream(server, [user("count to 6 [stall after 2 always]"), assistant("1 2")])
    result = Streamed()
    try:
        while len(result.deltas) < 2:
            record(await asyncio.wait_for(anext(response), TIMEOUT), result)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(response), 1.0)
    finally:
        await asyncio.wait_for(response.aclose(), TIMEOUT)

    assert result.deltas == [" 3", " 4"]
    await wait_until_idle(server)


# --- faults --------------------------------------------------------------------------------------


async def test_fail_before_first_chunk_with_429_raises_rate_limit_error(server: ScriptedModelServer) -> None:
    with pytest.raises(litellm.RateLimitError) as raised:
        await stream(server, [user("count to 5 [fail after 0 with 429]")])
    assert raised.value.response.headers["retry-after"] == str(RATE_LIMIT_RETRY_AFTER_S)


async def test_fail_before_first_chunk_with_500_raises_internal_server_error(
    server: ScriptedModelServer,
) -> None:
    with pytest.raises(litellm.InternalServerError, match="HTTP 500"):
        await stream(server, [user("count to 5 [fail after 0 with 500]")])


async def test_overflow_raises_context_window_exceeded(server: ScriptedModelServer) -> None:
    with pytest.raises(litellm.ContextWindowExceededError):
        await stream(server, [user("count to 5 [overflow]")])


async def test_stall_after_two_chunks_keeps_the_stream_open(server: ScriptedModelServer) -> None:
    response = await open_stream(server, [user("count to 10 [stall after 2]")])
    result = Streamed()
    try:
        while len(result.deltas) < 2:
            record(await asyncio.wait_for(anext(response), TIMEOUT), result)
        # The handler is stalling now. (After the timeout below, cancelling the read may close the
        # connection, which ends the handler: so count it before.)
        assert server.in_flight == 1
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(response), 1.0)
    finally:
        await asyncio.wait_for(response.aclose(), TIMEOUT)

    assert result.deltas == ["1", " 2"]
    assert result.finish_reasons == []
    await wait_until_idle(server)  # the stalled handler ends once the client has gone


async def test_mid_stream_failure_yields_chunks_then_raises(server: ScriptedModelServer) -> None:
    result = Streamed()
    with pytest.raises(MidStreamFallbackError, match="Scripted failure after 3 chunks"):
        await stream(server, [user("count to 10 [fail after 3 with 500]")], into=result)

    assert result.deltas == ["1", " 2", " 3"]
    assert result.finish_reasons == []


async def test_malformed_chunk_mid_stream_yields_chunks_then_raises(server: ScriptedModelServer) -> None:
    result = Streamed()
    with pytest.raises(MidStreamFallbackError, match="Expecting"):  # the JSON decoder's complaint
        await stream(server, [user("count to 10 [malformed after 3]")], into=result)

    assert result.deltas == ["1", " 2", " 3"]
    assert result.finish_reasons == []


async def test_reset_mid_stream_yields_chunks_then_raises_a_connection_error(
    server: ScriptedModelServer,
) -> None:
    result = Streamed()
    with pytest.raises(MidStreamFallbackError) as raised:
        await stream(server, [user("count to 10 [reset after 3]")], into=result)

    assert isinstance(raised.value.original_exception, litellm.APIConnectionError)
    assert result.deltas == ["1", " 2", " 3"]
    assert result.finish_reasons == []
    await wait_until_idle(server)


@pytest.mark.parametrize("directive", ["[malformed after 0]", "[reset after 0]"])
async def test_broken_stream_before_any_content(server: ScriptedModelServer, directive: str) -> None:
    result = Streamed()
    with pytest.raises(MidStreamFallbackError):
        await stream(server, [user(f"count to 10 {directive}")], into=result)
    assert result.deltas == []


@pytest.mark.parametrize("directive", ["[malformed after 1]", "[reset after 1]"])
async def test_non_streaming_broken_response_raises(server: ScriptedModelServer, directive: str) -> None:
    with pytest.raises(litellm.InternalServerError):
        await complete(server, [user(f"count to 4 {directive}")])


@pytest.mark.parametrize("directive", ["[malformed after 1 always]", "[reset after 1 always]"])
async def test_always_breaks_every_continuation_after_k_more_chunks(
    server: ScriptedModelServer, directive: str
) -> None:
    result = Streamed()
    with pytest.raises(MidStreamFallbackError):
        await stream(server, [user(f"count to 6 {directive}"), assistant("1 2")], into=result)
    assert result.deltas == [" 3"]


@pytest.mark.parametrize("fault", ["malformed", "reset"])
async def test_once_breaks_only_the_first_request_with_that_prompt(
    server: ScriptedModelServer, fault: str
) -> None:
    prompt = user(f"count to 4 [{fault} after 2 once] " + os.urandom(4).hex())
    with pytest.raises(MidStreamFallbackError):
        await stream(server, [prompt])
    retried = await stream(server, [prompt])  # a retry of the same user turn goes through
    assert "".join(retried.deltas) == "1 2 3 4"


def test_broken_stream_directives_parse_with_their_modifiers() -> None:
    directives = parse_directives("count to 5 [malformed after 2 ALWAYS] [reset after 3 once]")
    assert directives.malformed == Fault(2, always=True)
    assert directives.reset == Fault(3, always=False, once=True)
    assert parse_directives("[malformed after x] [reset]").malformed is None


# --- tools ---------------------------------------------------------------------------------------


async def test_tool_directive_streams_a_tool_call(server: ScriptedModelServer) -> None:
    result = await stream(server, [user('Look it up. [tool lookup {"q": "x"}]')])

    assert result.deltas == []
    assert result.finish_reasons == ["tool_calls"]
    first = result.tool_calls[0]
    assert first.id.startswith("call_")
    assert first.function.name == "lookup"
    arguments = "".join(call.function.arguments or "" for call in result.tool_calls)
    assert json.loads(arguments) == {"q": "x"}
    assert len([call for call in result.tool_calls if call.function.arguments]) >= 2
    assert all(call.index == 0 for call in result.tool_calls)


async def test_tool_call_non_streaming(server: ScriptedModelServer) -> None:
    response = await complete(server, [user('[tool lookup {"q": "x"}]')])

    call = response.choices[0].message.tool_calls[0]
    assert response.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "lookup"
    assert json.loads(call.function.arguments) == {"q": "x"}


async def test_tool_result_follow_up_returns_text(server: ScriptedModelServer) -> None:
    prompt = user('[tool lookup {"q": "x"}]')
    first = await stream(server, [prompt])
    call = first.tool_calls[0]
    arguments = "".join(c.function.arguments or "" for c in first.tool_calls)
    call_message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "lookup", "arguments": arguments}}
        ],
    }
    tool_message = {"role": "tool", "tool_call_id": call.id, "content": "x is 42"}

    result = await stream(server, [prompt, call_message, tool_message])

    assert "".join(result.deltas) == "Tool lookup returned: x is 42"
    assert result.deltas[0] == "Tool"
    assert result.finish_reasons == ["stop"]


PARALLEL = 'Look both up. [tool lookup {"q": "x"}] [tool weather {"city": "Paris"}]'
PARALLEL_CALLS = [("lookup", {"q": "x"}), ("weather", {"city": "Paris"})]


def names_and_arguments(calls: list[Any]) -> list[tuple[str, Any]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in calls]


async def test_parallel_tool_calls_stream_as_one_step(server: ScriptedModelServer) -> None:
    result = await stream(server, [user(PARALLEL)])

    assert result.deltas == []
    assert result.finish_reasons == ["tool_calls"]
    assert [(call.index, call.function.name) for call in result.tool_calls if call.id] == [
        (0, "lookup"),
        (1, "weather"),
    ]
    for index in (0, 1):  # each call streams its own arguments deltas
        pieces = [c.function.arguments for c in result.tool_calls if c.index == index and not c.id]
        assert len(pieces) >= 2
        assert json.loads("".join(pieces)) == PARALLEL_CALLS[index][1]
    calls = result.message().tool_calls
    assert names_and_arguments(calls) == PARALLEL_CALLS
    assert len({call.id for call in calls}) == 2
    assert result.usage.completion_tokens == len(result.tool_calls)


async def test_parallel_tool_calls_non_streaming(server: ScriptedModelServer) -> None:
    response = await complete(server, [user(PARALLEL)])

    assert response.choices[0].finish_reason == "tool_calls"
    calls = response.choices[0].message.tool_calls
    assert names_and_arguments(calls) == PARALLEL_CALLS
    assert len({call.id for call in calls}) == 2
    assert response.usage.completion_tokens == 8  # per call: the name delta and three argument pieces


async def test_tool_call_ids_are_unique_across_responses(server: ScriptedModelServer) -> None:
    first = await complete(server, [user(PARALLEL)])
    second = await stream(server, [user(PARALLEL)])

    ids = [call.id for call in first.choices[0].message.tool_calls] + [
        c.id for c in second.tool_calls if c.id
    ]
    assert len(ids) == len(set(ids)) == 4
    assert all(call_id.startswith("call_") for call_id in ids)


async def test_follow_up_joins_the_results_of_the_batch_in_order(server: ScriptedModelServer) -> None:
    prompt = user(PARALLEL)
    first = await complete(server, [prompt])
    lookup, weather = first.choices[0].message.tool_calls
    results = [tool_result(weather.id, "sunny"), tool_result(lookup.id, "x is 42")]  # order of the messages

    result = await stream(server, [prompt, call_message([lookup, weather]), *results])

    assert "".join(result.deltas) == "Tool weather returned: sunny; Tool lookup returned: x is 42"
    assert result.deltas[:3] == ["Tool", " weather", " returned:"]
    assert result.finish_reasons == ["stop"]
    non_streamed = await complete(server, [prompt, call_message([lookup, weather]), *results])
    assert non_streamed.choices[0].message.content == "".join(result.deltas)


async def test_count_after_a_tool_result_and_its_continuation(server: ScriptedModelServer) -> None:
    prompt = user("[tool lookup] then count to 4")
    first = await stream(server, [prompt])
    assert first.finish_reasons == ["tool_calls"]
    [call] = first.message().tool_calls
    history = [prompt, call_message([call]), tool_result(call.id, "ok")]

    result = await stream(server, history)
    assert result.deltas == ["Tool", " lookup", " returned:", " ok", " 1", " 2", " 3", " 4"]
    assert result.finish_reasons == ["stop"]

    resumed = await stream(server, [*history, assistant("Tool lookup returned: ok 1 2")])
    assert resumed.deltas == [" 3", " 4"]
    continue_prompt = user("Continue your previous response exactly where it stopped.")
    resumed = await stream(server, [*history, assistant("Tool lookup returned:"), continue_prompt])
    assert resumed.deltas == [" ok", " 1", " 2", " 3", " 4"]


async def test_times_k_calls_the_tool_again_until_k_results(server: ScriptedModelServer) -> None:
    messages = [user('Dig deeper. [tool lookup {"q": "x"} times 3]')]
    ids = []
    for k in range(1, 4):  # the prompt alone, then with 1 and 2 results: a call each time
        step = await stream(server, messages)
        assert step.finish_reasons == ["tool_calls"], k
        [call] = step.message().tool_calls
        assert names_and_arguments([call]) == [("lookup", {"q": "x"})]
        ids.append(call.id)
        messages += [call_message([call]), tool_result(call.id, f"result {k}")]

    final = await stream(server, messages)  # 3 results: the text of the latest batch

    assert "".join(final.deltas) == "Tool lookup returned: result 3"
    assert final.finish_reasons == ["stop"]
    assert len(set(ids)) == 3


def test_times_repeats_only_the_directives_short_of_results() -> None:
    prompt = user('[tool lookup {"q": "x"} times 2] [tool weather {"city": "Paris"}]')
    first = planned_calls(plan_reply([prompt], serial=1))
    assert [(c["id"], c["function"]["name"]) for c in first] == [
        ("call_1_0", "lookup"),
        ("call_1_1", "weather"),
    ]
    history = [prompt, call_message(first), tool_result("call_1_0", "x1"), tool_result("call_1_1", "sunny")]

    second = planned_calls(plan_reply(history, serial=2))
    assert [(c["id"], c["function"]["name"]) for c in second] == [("call_2_0", "lookup")]
    history += [call_message(second), tool_result("call_2_0", "x2")]

    assert planned_text(plan_reply(history, serial=3)) == "Tool lookup returned: x2"


def test_results_of_same_named_directives_count_by_their_arguments() -> None:
    prompt = user('[tool lookup {"q": "a"} times 2] [tool lookup {"q": "b"}]')
    first = planned_calls(plan_reply([prompt], serial=1))
    assert [json.loads(c["function"]["arguments"]) for c in first] == [{"q": "a"}, {"q": "b"}]
    # the client re-serializes the arguments and answers in the opposite order
    first[0]["function"]["arguments"] = '{ "q" : "a" }'
    history = [prompt, call_message(first), tool_result("call_1_1", "B"), tool_result("call_1_0", "A")]

    [second] = planned_calls(plan_reply(history, serial=2))  # "a" has 1 result of 2, "b" is done

    assert json.loads(second["function"]["arguments"]) == {"q": "a"}
    history += [call_message([second]), tool_result(second["id"], "A again")]
    assert planned_text(plan_reply(history, serial=3)) == "Tool lookup returned: A again"


def test_then_calls_again_with_the_next_arguments_once_the_first_call_has_its_result() -> None:
    """A model that corrects its input after a tool error: `[tool NAME {a} then {b}]`."""
    prompt = user('[tool add {"a": "two"} then {"a": 2} then {"a": 3}] [tool other]')
    first = planned_calls(plan_reply([prompt], serial=1))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first] == [
        ("add", {"a": "two"}),
        ("other", {}),
    ]
    history = [
        prompt,
        call_message(first),
        tool_result("call_1_0", "Error: a: bad"),
        tool_result("call_1_1", "ok"),
    ]

    [second] = planned_calls(plan_reply(history, serial=2))  # "other" is done; "add" has 1 result of 3
    assert json.loads(second["function"]["arguments"]) == {"a": 2}
    history += [call_message([second]), tool_result(second["id"], "still bad")]
    [third] = planned_calls(plan_reply(history, serial=3))
    assert json.loads(third["function"]["arguments"]) == {"a": 3}
    history += [call_message([third]), tool_result(third["id"], "3")]

    assert planned_text(plan_reply(history, serial=4)) == "Tool add returned: 3"


@pytest.mark.parametrize(
    ("directive", "message"),
    [
        ('[tool f {} then {"a": 1} times 2]', "'then' and 'times' cannot be combined"),
        ("[tool f {} then {oops}]", "'then' arguments are not valid JSON"),
    ],
)
def test_bad_then_is_refused(directive: str, message: str) -> None:
    with pytest.raises(BadRequestError, match=re.escape(message)):
        plan_reply([user(directive)])


def test_a_tool_directive_inside_json_arguments_is_not_a_directive() -> None:
    calls = planned_calls(plan_reply([user('[tool note {"text": "[tool other]"}]')]))

    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("note", {"text": "[tool other]"})
    ]


@pytest.mark.parametrize(
    ("directive", "message"),
    [
        ("[tool f {} times 0]", "'times' needs a whole number K >= 1, got '0'"),
        ("[tool f times -1]", "'times' needs a whole number K >= 1, got '-1'"),
        ('[tool f {"a": 1} times x]', "'times' needs a whole number K >= 1, got 'x'"),
        ("[tool f {} times]", "'times' needs a whole number K >= 1, got ''"),
        ("[tool f {} times 2 3]", "expected ']' or 'times K]' after the arguments"),
    ],
)
async def test_bad_times_gets_400(server: ScriptedModelServer, directive: str, message: str) -> None:
    await assert_refused(server, directive, message, f"[tool f]: {message}")


async def assert_refused(
    server: ScriptedModelServer, directive: str, message: str, http_message: str
) -> None:
    """plan_reply raises with `message`, and the server answers 400 with `http_message`."""
    with pytest.raises(BadRequestError, match=re.escape(message)):
        plan_reply([user(directive)])

    status, text = await raw_post(server, {"messages": [user(directive)], "stream": True})

    assert status == 400
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == http_message


# --- context window ------------------------------------------------------------------------------


def window_message(limit: int, tokens: int) -> str:
    return (
        f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
        f"{tokens} tokens. Please reduce the length of the messages."
    )


def tokens_of(*texts: str) -> int:
    """``prompt_tokens`` of plain text messages, by the documented formula."""
    return math.ceil(sum(len(text) for text in texts) / 4) + 4 * len(texts)


async def run(server: ScriptedModelServer, messages: list[dict[str, Any]], streamed: bool) -> str:
    """The text of a completion, streamed or not."""
    if streamed:
        return "".join((await stream(server, messages)).deltas)
    return str((await complete(server, messages)).choices[0].message.content)


@pytest.mark.parametrize("streamed", [True, False])
async def test_window_exceeded_raises_context_window_exceeded(
    server: ScriptedModelServer, streamed: bool
) -> None:
    prompt = "count to 3 [window 9]"
    assert tokens_of(prompt) == 10
    for _ in range(2):  # not a one-shot fault: a retry of the same prompt overflows again
        with pytest.raises(litellm.ContextWindowExceededError) as raised:
            await run(server, [user(prompt)], streamed)
        assert window_message(9, 10) in str(raised.value)


async def test_window_error_body_has_openai_shape(server: ScriptedModelServer) -> None:
    for streamed in (True, False):
        status, text = await raw_post(
            server, {"messages": [user("count to 3 [window 9]")], "stream": streamed}
        )

        assert status == 400
        assert json.loads(text)["error"] == {
            "message": window_message(9, 10),
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }


@pytest.mark.parametrize("streamed", [True, False])
async def test_within_the_window_the_answer_is_normal(server: ScriptedModelServer, streamed: bool) -> None:
    prompt = "count to 3 [WINDOW 10]"  # exactly 10 prompt tokens: not more than the window
    assert tokens_of(prompt) == 10

    assert await run(server, [user(prompt)], streamed) == "1 2 3"


async def test_window_applies_to_a_tool_result_follow_up(server: ScriptedModelServer) -> None:
    prompt = user("[tool lookup] [window 40]")
    first = await stream(server, [prompt])
    [call] = first.message().tool_calls
    small = [prompt, call_message([call]), tool_result(call.id, "ok")]
    large = [prompt, call_message([call]), tool_result(call.id, "x" * 200)]
    assert count_prompt_tokens(small) <= 40 < count_prompt_tokens(large)

    assert "".join((await stream(server, small)).deltas) == "Tool lookup returned: ok"
    with pytest.raises(litellm.ContextWindowExceededError) as raised:
        await stream(server, large)
    assert window_message(40, count_prompt_tokens(large)) in str(raised.value)


@pytest.mark.parametrize("streamed", [True, False])
async def test_window_applies_to_a_continuation(server: ScriptedModelServer, streamed: bool) -> None:
    prompt = "count to 40 [window 20]"
    short = [user(prompt), assistant("1 2 3")]
    long = [user(prompt), assistant(" ".join(str(i) for i in range(1, 31)))]
    continued = [*short, user("Continue your previous response exactly where it stopped.")]
    assert tokens_of(prompt, "1 2 3") <= 20 < tokens_of(*(m["content"] for m in continued))

    assert (await run(server, short, streamed)).split() == [str(i) for i in range(4, 41)]
    for messages in (long, continued):
        with pytest.raises(litellm.ContextWindowExceededError) as raised:
            await run(server, messages, streamed)
        assert window_message(20, count_prompt_tokens(messages)) in str(raised.value)


@pytest.mark.parametrize(
    ("directive", "message"),
    [
        ("[window 0]", "[window]: needs a whole number of tokens N >= 1, got '0'"),
        ("[window -5]", "[window]: needs a whole number of tokens N >= 1, got '-5'"),
        ("[window 2.5]", "[window]: needs a whole number of tokens N >= 1, got '2.5'"),
        ("[window x]", "[window]: needs a whole number of tokens N >= 1, got 'x'"),
        ("[window]", "[window]: needs a whole number of tokens N >= 1, got ''"),
        ("[window 5 always]", "[window 5]: expected ']' after the number of tokens"),
        ("count to 3 [window 5", "[window 5]: expected ']' after the number of tokens"),
    ],
)
async def test_bad_window_gets_400(server: ScriptedModelServer, directive: str, message: str) -> None:
    await assert_refused(server, directive, message, message)


# --- summarisation requests ----------------------------------------------------------------------

TRANSCRIPT = """user: count to 5 [overflow] [window 1]

assistant: [tool lookup {"q": "x"}] [fail after 0 with 500]
   \t
tool: [stall after 0 always] [window 0] [tool f times 0]
user: [overflow always] [fail after 1 with 429 always]
"""


def summary_request(transcript: str = TRANSCRIPT) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": f"{SUMMARY_MARKER} in a few lines. [window 1] [overflow]"},
        user("Earlier line one\nEarlier line two\nthree\nfour\nfive\nsix"),
        assistant("count to 9"),
        user(transcript),
    ]


def test_summary_plan_counts_the_non_empty_lines_of_the_last_user_message() -> None:
    plan = plan_reply(summary_request(), serial=3)

    assert planned_text(plan) == "Summary of 4 lines."
    assert [d["content"] for d in plan.deltas] == ["Summary", " of", " 4", " lines."]
    assert plan.directives == Directives()
    assert plan.summary
    assert planned_text(plan_reply(summary_request("one line, no newline"))) == "Summary of 1 lines."
    assert planned_text(plan_reply(summary_request(""))) == "Summary of 0 lines."
    parts = [{"type": "text", "text": "a\n"}, {"type": "text", "text": "\nb"}]
    assert planned_text(plan_reply([*summary_request()[:1], {"role": "user", "content": parts}])) == (
        "Summary of 2 lines."
    )


@pytest.mark.parametrize("streamed", [True, False])
async def test_summary_request_ignores_directives_and_never_faults(
    server: ScriptedModelServer, streamed: bool
) -> None:
    messages = summary_request()
    assert count_prompt_tokens(messages) > 1  # the [window 1] in it would overflow if it were read
    before = len(server.requests)

    for _ in range(2):  # the [... always] faults would fire on every request
        if streamed:
            result = await stream(server, messages)
            assert result.deltas == ["Summary", " of", " 4", " lines."]
            assert result.finish_reasons == ["stop"]
            assert result.usage.completion_tokens == 4
        else:
            assert await run(server, messages, streamed) == "Summary of 4 lines."

    assert [r["messages"] for r in server.requests[before:]] == [messages, messages]


async def test_marker_outside_a_system_message_is_not_a_summary_request(server: ScriptedModelServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, user(f"{SUMMARY_MARKER}: count to 2")]

    assert await run(server, messages, True) == "1 2"
    with pytest.raises(litellm.ContextWindowExceededError):
        await run(
            server, [{"role": "system", "content": "Be brief."}, user(f"{SUMMARY_MARKER} [window 1]")], True
        )


# --- pacing --------------------------------------------------------------------------------------


async def test_rate_directive_overrides_slow_server_pacing(slow_server: ScriptedModelServer) -> None:
    # Paced at 0.2 chunks/s these 50 chunks would take minutes; [rate 0] streams them unpaced.
    result = await stream(slow_server, [user("count to 50 [rate 0]")])

    assert result.deltas == ["1"] + [f" {i}" for i in range(2, 51)]
    assert result.usage.completion_tokens == 50


async def test_hurry_sends_the_rest_of_a_paced_reply_at_once(slow_server: ScriptedModelServer) -> None:
    # At 0.2 chunks/s the 20 numbers take 100 s, far past TIMEOUT: they all come once the server hurries,
    # the pause under way included.
    started = asyncio.ensure_future(stream(slow_server, [user("count to 20")]))
    try:
        async with asyncio.timeout(TIMEOUT):
            while not slow_server.in_flight:
                await asyncio.sleep(0.05)
        slow_server.hurry()
        result = await started
    finally:
        slow_server.hurry(False)
    assert result.deltas == ["1"] + [f" {i}" for i in range(2, 21)]


def test_token_rate_comes_from_argument_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCRIPTED_MODEL_TOKEN_RATE", "7.5")
    assert build_app()[STATE_KEY].token_rate == 7.5
    assert build_app(token_rate=0)[STATE_KEY].token_rate == 0.0
    monkeypatch.setenv("SCRIPTED_MODEL_TOKEN_RATE", "not-a-number")
    assert build_app()[STATE_KEY].token_rate == DEFAULT_TOKEN_RATE
    monkeypatch.delenv("SCRIPTED_MODEL_TOKEN_RATE")
    assert build_app()[STATE_KEY].token_rate == DEFAULT_TOKEN_RATE == 20.0


# --- wire format ---------------------------------------------------------------------------------


async def test_sse_wire_format_matches_openai(server: ScriptedModelServer) -> None:
    messages = [user("count to 3")]
    body = {
        "model": "scripted",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, text = await raw_post(server, body)

    assert status == 200
    payloads = sse_payloads(text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert {c["model"] for c in chunks} == {"scripted"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:4]]
    assert contents == ["1", " 2", " 3"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:4])
    assert chunks[4]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert chunks[5]["choices"] == []
    prompt_tokens = math.ceil(len("count to 3") / 4) + 4
    assert chunks[5]["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 3,
        "total_tokens": prompt_tokens + 3,
    }
    assert len(chunks) == 6


async def test_mid_stream_error_line_ends_stream_without_done(server: ScriptedModelServer) -> None:
    status, text = await raw_post(
        server, {"messages": [user("count to 9 [fail after 2 with 503]")], "stream": True}
    )

    assert status == 200
    payloads = sse_payloads(text)
    assert "[DONE]" not in payloads
    error = json.loads(payloads[-1])["error"]
    assert error["type"] == "server_error"
    assert error["code"] == 503
    assert [json.loads(p)["choices"][0]["delta"].get("content") for p in payloads[1:-1]] == ["1", " 2"]


async def test_malformed_line_is_not_json_and_ends_the_stream_without_done(
    server: ScriptedModelServer,
) -> None:
    status, text = await raw_post(
        server, {"messages": [user("count to 9 [malformed after 2]")], "stream": True}
    )

    assert status == 200
    payloads = sse_payloads(text)
    assert "[DONE]" not in payloads
    assert [json.loads(p)["choices"][0]["delta"].get("content") for p in payloads[1:-1]] == ["1", " 2"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(payloads[-1])
    assert payloads[-1].startswith('{"id": "chatcmpl-scripted-')  # a chunk cut off mid-object


async def test_reset_closes_the_connection_without_ending_the_chunked_body(
    server: ScriptedModelServer,
) -> None:
    received = b""
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    body = {"messages": [user("count to 9 [reset after 2]")], "stream": True}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{server.url}/chat/completions", json=body) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                async for piece in resp.content.iter_any():
                    received += piece
    payloads = sse_payloads(received.decode())
    assert [json.loads(p)["choices"][0]["delta"].get("content") for p in payloads[1:]] == ["1", " 2"]
    await wait_until_idle(server)


async def test_error_bodies_have_openai_shape(server: ScriptedModelServer) -> None:
    status, text = await raw_post(server, {"messages": [user("[fail after 0 with 429]")], "stream": True})
    assert status == 429
    error = json.loads(text)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")

    status, text = await raw_post(server, {"messages": [user("[overflow]")]})
    assert status == 400
    assert json.loads(text)["error"] == {
        "message": OVERFLOW_MESSAGE,
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert "maximum context length is 128000 tokens" in OVERFLOW_MESSAGE


@pytest.mark.parametrize(
    "body", ["{not json", json.dumps({"messages": []}), json.dumps({"messages": [user('[tool f {"a": ]')]})]
)
async def test_bad_requests_get_400_with_error_body(server: ScriptedModelServer, body: str) -> None:
    status, text = await raw_post(server, body)

    assert status == 400
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]


async def test_models_and_healthz(server: ScriptedModelServer) -> None:
    base = server.url.removesuffix("/v1")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        async with session.get(f"{server.url}/models") as resp:
            assert resp.status == 200
            models = await resp.json()
        async with session.get(f"{base}/healthz") as resp:
            assert resp.status == 200
            assert await resp.text() == "ok"

    assert [m["id"] for m in models["data"]] == ["scripted"]
    assert models["object"] == "list"


async def test_once_fault_fires_only_on_the_first_request_with_that_prompt(
    server: ScriptedModelServer,
) -> None:
    prompt = user("count to 4 [fail after 0 with 500 once] " + os.urandom(4).hex())
    with pytest.raises(litellm.InternalServerError):
        await stream(server, [prompt])
    retried = await stream(server, [prompt])  # a retry of the same user turn goes through
    assert "".join(retried.deltas) == "1 2 3 4"


async def test_stamp_appends_the_send_time_to_each_delta(server: ScriptedModelServer) -> None:
    import time

    before = time.time()
    result = await stream(server, [user("count to 3 [stamp]")])
    after = time.time()
    pieces = [delta.split("@") for delta in result.deltas]
    assert [text for text, _ in pieces] == ["1", " 2", " 3"]
    assert all(before <= float(stamp) <= after for _, stamp in pieces)


async def test_a_declared_context_window_holds_every_request_but_summaries_and_a_prompts_own() -> None:
    """The demo's model declares a window (think_scripted.kwargs.CONTEXT_WINDOW): a prompt over it is
    refused as a provider would, a summarisation request is not, and `[window N]` in a prompt wins."""
    with ScriptedModelServer(token_rate=0, context_window=20) as windowed:
        status, text = await raw_post(windowed, {"messages": [user("count to 3 " + "word " * 40)]})
        assert status == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded"
        assert window_message(20, tokens_of("count to 3 " + "word " * 40)) in text
        assert await run(windowed, [user("count to 3")], True) == "1 2 3"
        assert await run(windowed, [user("count to 3 [window 1000] " + "word " * 40)], True) == "1 2 3"
        long_summary = summary_request("line\n" * 200)
        assert (await run(windowed, long_summary, False)).startswith("Summary of ")


async def test_a_request_body_over_one_mebibyte_is_read(server: ScriptedModelServer) -> None:
    """aiohttp's default (1 MiB) refused the history of a long conversation before any window could."""
    history = [user(f"m{i}: " + "x" * 200) if i % 2 == 0 else assistant("ok") for i in range(12_000)]
    body = {"messages": [*history, user("count to 2")]}
    assert len(json.dumps(body)) > 1024 * 1024
    status, text = await raw_post(server, body)
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == "1 2"


def test_the_demo_model_declares_its_window_to_litellm_too() -> None:
    from think_scripted.kwargs import CONTEXT_WINDOW, LITELLM_MODELS

    assert CONTEXT_WINDOW == 128_000
    assert {m["max_input_tokens"] for m in LITELLM_MODELS.values()} == {CONTEXT_WINDOW}
