"""kebab() and the agent registry."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from chat.agents import Think
from chat.checks import check_think_settings
from chat.exceptions import UnknownAgent
from chat.turn.registry import agent_class, agent_for, agent_names, kebab
from thinkproject.agents import Assistant


class CustomAgent(Think):
    def get_system_prompt(self) -> str | None:
        return "custom"


class NotAnAgent:
    pass


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ChatAgent", "chat-agent"),
        ("ThinkContextOverflowE2EAgent", "think-context-overflow-e2-e-agent"),
        ("MY_AGENT", "my-agent"),
        ("assistant", "assistant"),
        ("my_agent", "my-agent"),
        ("MyThinkAgent", "my-think-agent"),
        ("chatAgent", "chat-agent"),
        ("Agent", "agent"),
        ("AGENT", "agent"),
        ("E2E", "e2e"),
        ("MY_AGENT_2", "my-agent-2"),
        ("My_Agent", "my--agent"),
        ("Agent_", "agent"),
        ("already-kebab", "already-kebab"),
        ("HTTPAgent", "h-t-t-p-agent"),
    ],
)
def test_kebab(name: str, expected: str) -> None:
    assert kebab(name) == expected


@pytest.mark.parametrize(("name", "expected"), [("Agent__", "agent-"), ("-Agent", "-agent")])
def test_kebab_drops_only_one_leading_or_trailing_dash(name: str, expected: str) -> None:
    assert kebab(name) == expected


def test_agent_class_default_registry() -> None:
    assert agent_class("assistant") is Assistant


def test_agent_names(settings: Any) -> None:
    settings.THINK = {
        "AGENTS": {"assistant": "thinkproject.agents.Assistant", "helper": "thinkproject.agents.Assistant"}
    }
    assert agent_names() == ["assistant", "helper"]


@pytest.mark.parametrize("name", ["nope", "Assistant", "assistant-", "", "thinkproject.agents.Assistant"])
def test_unknown_agent(name: str) -> None:
    with pytest.raises(UnknownAgent):
        agent_class(name)


def test_unknown_agent_is_a_lookup_error() -> None:
    assert issubclass(UnknownAgent, LookupError)


def test_custom_registration_is_read_at_access_time(settings: Any) -> None:
    settings.THINK = {"AGENTS": {"MyCustomAgent": "tests.chat.turn.test_agents.CustomAgent"}}
    assert agent_class("my-custom-agent") is CustomAgent
    assert agent_names() == ["MyCustomAgent"]
    with pytest.raises(UnknownAgent):
        agent_class("assistant")
    with pytest.raises(UnknownAgent):
        agent_class("MyCustomAgent")


def test_several_registrations(settings: Any) -> None:
    settings.THINK = {
        "AGENTS": {
            "assistant": "thinkproject.agents.Assistant",
            "SUPPORT_BOT": "tests.chat.turn.test_agents.CustomAgent",
        }
    }
    assert agent_class("assistant") is Assistant
    assert agent_class("support-bot") is CustomAgent


def test_the_apps_name_no_agent_of_their_own(settings: Any) -> None:
    """The demo's agent lives in the demo site: a site that names no agents has none."""
    settings.THINK = {"GROUP_PREFIX": "x"}
    assert agent_names() == []
    with pytest.raises(UnknownAgent):
        agent_class("assistant")


def test_without_a_model_an_agent_says_so_instead_of_calling_anything(settings: Any) -> None:
    settings.THINK = {"AGENTS": {"custom": "tests.chat.turn.test_agents.CustomAgent"}}
    with pytest.raises(ImproperlyConfigured, match="THINK\\['MODEL'\\] is not set"):
        CustomAgent(agent="custom", name="n").completion_kwargs()


def test_the_check_names_each_agent_without_a_model(settings: Any) -> None:
    class OwnModel(Think):
        def get_model(self) -> Any:
            return "openai/gpt-test"

    globals()["OwnModel"] = OwnModel  # importable by its dotted path
    agents = {
        "custom": "tests.chat.turn.test_agents.CustomAgent",
        "own": "tests.chat.turn.test_agents.OwnModel",
    }
    settings.THINK = {"AGENTS": agents}
    errors = [e for e in check_think_settings() if e.id == "think_chat.E011"]
    assert [e.msg.split(":")[0] for e in errors] == ["Agent 'custom' has no model"]
    settings.THINK = {"AGENTS": agents, "MODEL": "openai/gpt-test"}
    assert [e.id for e in check_think_settings()] == []


def test_the_demo_site_names_its_scripted_model_for_litellm() -> None:
    from chat.turn.llm import load_litellm

    litellm = load_litellm()
    assert litellm.model_cost["openai/scripted"]["mode"] == "chat"  # not in litellm's own map


def test_registration_that_is_not_a_think_subclass_is_unknown(settings: Any) -> None:
    settings.THINK = {"AGENTS": {"plain": "tests.chat.turn.test_agents.NotAnAgent", "func": "json.dumps"}}
    with pytest.raises(UnknownAgent):
        agent_class("plain")
    with pytest.raises(UnknownAgent):
        agent_class("func")


def test_agent_for_builds_an_instance(settings: Any) -> None:
    settings.THINK = {"AGENTS": {"custom": "tests.chat.turn.test_agents.CustomAgent"}}
    agent = agent_for("custom", "room-1", 7)
    assert isinstance(agent, CustomAgent)
    assert (agent.agent, agent.name, agent.conversation_id) == ("custom", "room-1", 7)
    assert agent.get_system_prompt() == "custom"


def test_assistant_has_a_system_prompt() -> None:
    assert Assistant(agent="assistant", name="n").get_system_prompt() == "You are a helpful assistant."
    assert Think(agent="a", name="n").get_system_prompt() is None


def test_completion_kwargs(settings: Any) -> None:
    settings.THINK = {"MODEL": "openai/gpt-test"}
    assert Think(agent="a", name="n").completion_kwargs() == {"model": "openai/gpt-test"}

    class DictModel(Think):
        def get_model(self) -> Any:
            return {"model": "m", "api_base": "http://x"}

    assert DictModel(agent="a", name="n").completion_kwargs() == {"model": "m", "api_base": "http://x"}

    class BadModel(Think):
        def get_model(self) -> Any:
            return {"api_base": "http://x"}

    with pytest.raises(TypeError, match="BadModel.get_model"):
        BadModel(agent="a", name="n").completion_kwargs()
