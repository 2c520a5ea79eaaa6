"""Calls built without litellm (chat.turn.plain_openai) against the calls litellm builds and reads.

For every model and parameter the plain route takes, its request (URL, headers, body) is the request
litellm's route builds; its events, errors and error classes are those of litellm's read. Every model
litellm treats specially, every other provider and every call with something the plain route does not
know goes to litellm. These tests run with litellm loaded (to compare), so the plain route is switched
on by pretending it is not: `plain_openai.litellm_loaded`.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import json  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from decimal import Decimal  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from django.test import override_settings  # noqa: E402

from chat.turn import llm, openai_compat, plain_openai  # noqa: E402
from chat.turn.errors import default_chat_error_classifier, retry_after_s  # noqa: E402
from chat.turn.pricing import ModelPrices, needs_litellm, step_cost  # noqa: E402
from think_scripted.server import ScriptedModelServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# The shapes chat.transcript.model_messages sends: system, user, an assistant step with tool calls and
# no text, the tools' outputs, a partial answer.
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    {"role": "assistant", "content": "It is sun"},
    {"role": "user", "content": "Continue.", "name": "someone"},
]
# One value of every parameter the plain route takes.
PARAM_VALUES: dict[str, Any] = {
    "temperature": 0.3,
    "top_p": 0.9,
    "max_tokens": 50,
    "max_completion_tokens": 60,
    "stop": ["\n\n"],
    "seed": 7,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.2,
    "reasoning_effort": "low",
    "parallel_tool_calls": False,
    "tool_choice": "auto",
    "response_format": {"type": "json_object"},
}


@pytest.fixture(autouse=True)
def litellm_loaded() -> None:
    llm.load_litellm()


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain route, as in a worker that has not imported litellm."""
    monkeypatch.setattr(plain_openai, "litellm_loaded", lambda: False)


def requests(model: dict[str, Any], messages: list[Any], **extra: Any) -> tuple[Any, Any]:
    """(litellm's request, the plain route's request) for one call."""
    through_litellm = openai_compat.lean_request(model, messages, **extra)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plain_openai, "litellm_loaded", lambda: False)
        built = plain_openai.request(model, messages, **extra)
    return through_litellm, built


def assert_same(model: dict[str, Any], messages: list[Any] = MESSAGES, **extra: Any) -> None:
    through_litellm, built = requests(model, messages, **extra)
    assert through_litellm is not None and built is not None
    assert built.url == through_litellm.url
    assert built.headers == through_litellm.headers
    assert json.loads(built.body) == json.loads(through_litellm.body)
    assert (built.model, built.provider, built.timeout) == (
        through_litellm.model,
        through_litellm.provider,
        through_litellm.timeout,
    )


BASE = "http://127.0.0.1:9/v1"


@pytest.mark.parametrize(
    "name",
    ["scripted", "llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct", "qwen2.5:7b", "my-alias"],
)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_request_is_litellms_request(name: str, tools: list[Any] | None) -> None:
    extra = {"tools": tools} if tools else {}
    assert_same({"model": f"openai/{name}", "api_base": BASE, "api_key": "sk-1"}, **extra)


@pytest.mark.parametrize("param", sorted(PARAM_VALUES))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_each_parameter_is_sent_as_litellm_sends_it(param: str, tools: list[Any] | None) -> None:
    extra = {"tools": tools} if tools else {}
    assert_same({"model": "openai/scripted", "api_base": BASE, param: PARAM_VALUES[param]}, **extra)


def test_every_parameter_at_once_and_parameters_left_unset() -> None:
    assert_same({"model": "openai/scripted", "api_base": BASE, **PARAM_VALUES}, tools=TOOLS)
    assert_same({"model": "openai/scripted", "api_base": BASE, "temperature": None, "stop": None})
    assert set(PARAM_VALUES) | {"tools"} == plain_openai.PARAMS, "every parameter taken is compared"


@pytest.mark.parametrize(
    "base",
    [
        "http://127.0.0.1:9/v1",
        "http://127.0.0.1:9/v1/",
        "http://127.0.0.1:9/v1//",
        "https://llm.example.com/openai/v1",
        "http://127.0.0.1:9/v1/chat/completions",
        "http://127.0.0.1:9",
    ],
)
def test_base_urls_as_litellm_joins_them(base: str) -> None:
    assert_same({"model": "openai/scripted", "api_base": base})
    assert_same({"model": "openai/scripted", "base_url": base})


@pytest.mark.parametrize("key_in_env", [False, True])
def test_keys_and_headers(monkeypatch: pytest.MonkeyPatch, key_in_env: bool) -> None:
    monkeypatch.setattr(openai_compat, "_routes", {})  # litellm's routes are kept per process
    if key_in_env:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    else:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert_same({"model": "openai/scripted", "api_base": BASE})
    assert_same({"model": "openai/scripted", "api_base": BASE, "api_key": "sk-own"})
    assert_same(
        {"model": "openai/scripted", "api_base": BASE, "extra_headers": {"X-Team": "a"}, "timeout": 30}
    )
    assert_same({"model": "openai/scripted", "api_base": BASE, "extra_headers": {"content-type": "text/x"}})


def names_litellm_treats_specially() -> list[str]:
    import litellm

    return sorted(set(litellm.open_ai_chat_completion_models) | set(litellm.open_ai_text_completion_models))


def test_no_model_litellm_knows_goes_the_plain_way() -> None:
    """Every model in litellm's OpenAI catalog gets litellm's own config (o-series, GPT-5, ...)."""
    names = names_litellm_treats_specially()
    assert len(names) > 100
    taken = [n for n in names if plain_openai.model_qualifies(f"openai/{n}")]
    assert taken == []


@pytest.mark.parametrize(
    "model",
    [
        {"model": "openai/gpt-4o-mini-proxy-alias", "api_base": BASE},  # looks like OpenAI's
        {"model": "openai/o9-preview", "api_base": BASE},
        {"model": "openai/scripted"},  # no base URL: OpenAI itself
        {"model": "openai/scripted", "api_base": "unix:/tmp/x"},
        {"model": "hosted_vllm/llama", "api_base": BASE},  # another provider's config
        {"model": "anthropic/scripted", "api_base": BASE},
        {"model": "scripted", "api_base": BASE},
        {"model": "openai/scripted", "api_base": BASE, "logprobs": True},  # a parameter not compared
        {"model": "openai/scripted", "api_base": BASE, "extra_body": {"x": 1}},
        {"model": "openai/scripted", "api_base": BASE, "extra_headers": "X-Team: a"},
    ],
)
def test_what_goes_to_litellm(plain: None, model: dict[str, Any]) -> None:
    assert plain_openai.request(model, MESSAGES) is None


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}],
        },
        {"role": "developer", "content": "hi"},
        {"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}},
    ],
)
def test_messages_other_than_text_go_to_litellm(plain: None, message: dict[str, Any]) -> None:
    assert plain_openai.request({"model": "openai/scripted", "api_base": BASE}, [message]) is None


def test_nothing_goes_the_plain_way_once_litellm_is_loaded() -> None:
    assert plain_openai.request({"model": "openai/scripted", "api_base": BASE}, MESSAGES) is None


def test_nor_when_the_site_asks_for_litellms_remote_cost_map(
    plain: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "False")
    assert plain_openai.request({"model": "openai/scripted", "api_base": BASE}, MESSAGES) is None
    assert not plain_openai.unpriced_without_litellm("openai/scripted")


# -- reading the stream -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer(token_rate=0) as srv:
        yield srv


async def collect(server: ScriptedModelServer, prompt: str, **extra: Any) -> list[Any]:
    model = {"model": "openai/scripted", "api_base": server.url, "api_key": "sk-scripted"}
    messages = [{"role": "user", "content": prompt}]
    return [e async for e in llm.stream_chat(model=model, messages=messages, **extra)]


async def outcome(server: ScriptedModelServer, prompt: str, **extra: Any) -> BaseException:
    with pytest.raises(Exception) as raised:
        await asyncio.wait_for(collect(server, prompt, **extra), 10)
    return raised.value


async def test_a_plain_call_streams_what_litellms_route_streams(
    server: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = '[tool get_weather {"city": "Oslo"}] count to 4'
    through_litellm = await collect(server, prompt, tools=TOOLS)
    litellm_body = server.requests[-1]
    monkeypatch.setattr(plain_openai, "litellm_loaded", lambda: False)
    built = []
    monkeypatch.setattr(openai_compat, "lean_request", lambda *a, **k: built.append(a) or None)
    plain = await collect(server, prompt, tools=TOOLS)
    assert built == [], "the plain route built the request, not litellm's"
    assert server.requests[-1] == litellm_body
    strip = [(type(e), getattr(e, "text", None), getattr(e, "name", None)) for e in plain]
    assert strip == [(type(e), getattr(e, "text", None), getattr(e, "name", None)) for e in through_litellm]
    assert isinstance(plain[-1], llm.Usage) and plain[-1].total_tokens > 0


@pytest.mark.parametrize(
    "directive",
    [
        "[fail after 0 with 429]",
        "[fail after 0 with 500]",
        "[fail after 3 with 503]",
        "[malformed after 3]",
        "[reset after 0]",
        "[eof after 0]",
        "[eof after 3]",
        "[fail after 0 with 400]",
        "[fail after 0 with 401]",
        "[overflow]",
    ],
)
async def test_a_plain_calls_errors_are_litellms(
    server: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch, directive: str
) -> None:
    through_litellm = await outcome(server, f"count to 5 {directive}", lean=False)  # litellm's own read
    litellms_route = await outcome(server, f"count to 5 {directive}")  # the lean read, litellm's route
    monkeypatch.setattr(plain_openai, "litellm_loaded", lambda: False)
    loads: list[bool] = []
    real = llm.ensure_litellm

    async def ensure() -> Any:
        loads.append(True)
        return await real()

    monkeypatch.setattr(openai_compat, "ensure_litellm", ensure)
    plain = await outcome(server, f"count to 5 {directive}")
    assert loads == [True], "litellm is loaded (off the loop) to map the error"
    assert type(plain) is type(litellms_route)
    assert default_chat_error_classifier(plain) == default_chat_error_classifier(through_litellm)
    assert retry_after_s(plain) == retry_after_s(through_litellm)


# -- pricing ------------------------------------------------------------------------------------------
def test_a_model_litellm_cannot_price_is_unpriced_without_it(plain: None) -> None:
    from chat.turn.llm import Usage

    usage = Usage(100, 20, 120, 0)
    for model in ("openai/scripted", "openai/llama-3.1-8b-instruct"):
        assert plain_openai.unpriced_without_litellm(model)
        assert not needs_litellm(None, model)
        assert step_cost(None, model, usage) is None
    # litellm itself agrees: it has no price for them either
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plain_openai, "litellm_loaded", lambda: True)
        assert step_cost(None, "openai/llama-3.1-8b-instruct", usage) is None
        assert step_cost(None, "openai/scripted", usage) is None


def test_a_model_with_a_price_asks_litellm(plain: None) -> None:
    priced = {
        "openai/house-model": {"litellm_provider": "openai", "mode": "chat", "input_cost_per_token": 1e-6}
    }
    with override_settings(THINK={"LITELLM_MODELS": priced}):
        assert not plain_openai.unpriced_without_litellm("openai/house-model")
        assert needs_litellm(None, "openai/house-model")
    assert needs_litellm(None, "openai/gpt-4o-mini"), "a model of litellm's map"
    assert not needs_litellm(ModelPrices(Decimal("0.000001"), Decimal("0.000002")), "openai/gpt-4o-mini")
    assert not needs_litellm(None, None)


# -- when a worker imports litellm (THINK["PRELOAD_LITELLM"] = "auto") ------------------------------
@pytest.mark.parametrize(
    ("agents", "model", "needs"),
    [
        ({"assistant": "thinkproject.agents.Assistant"}, "scripted", False),
        (
            {"assistant": "thinkproject.agents.Assistant", "priced": "tests.agents.PricedAgent"},
            "scripted",
            False,
        ),
        ({"assistant": "thinkproject.agents.Assistant"}, "anthropic/claude-sonnet-4-5", True),
        ({"assistant": "thinkproject.agents.Assistant"}, "openai/gpt-4o-mini", True),
        ({"a": "thinkproject.agents.Assistant", "l": "tests.agents.LitellmReadAgent"}, "scripted", True),
        ({"a": "thinkproject.agents.Assistant", "r": "tests.agents.ReattachAgent"}, "scripted", True),
        ({"a": "tests.agents.NoSuchAgent"}, "scripted", True),
    ],
)
def test_a_worker_preloads_litellm_when_some_agent_may_need_it(
    agents: dict[str, str], model: str, needs: bool
) -> None:
    from chat.tasks import models_need_litellm
    from think_scripted.kwargs import LITELLM_MODELS, litellm_kwargs

    kwargs: Any = litellm_kwargs("http://127.0.0.1:9") if model == "scripted" else model
    think = {"AGENTS": agents, "MODEL": kwargs, "LITELLM_MODELS": LITELLM_MODELS}
    with override_settings(THINK=think):
        assert models_need_litellm() is needs


@pytest.mark.parametrize("value", ["yes", 1, 0, None, "AUTO"])
def test_an_unknown_preload_policy_fails_the_checks(value: Any) -> None:
    from django.conf import settings

    from chat.checks import check_think_settings

    with override_settings(THINK={**settings.THINK, "PRELOAD_LITELLM": value}):
        assert "think_chat.E028" in [m.id for m in check_think_settings()]
    for good in ("auto", True, False):
        with override_settings(THINK={**settings.THINK, "PRELOAD_LITELLM": good}):
            assert "think_chat.E028" not in [m.id for m in check_think_settings()]
