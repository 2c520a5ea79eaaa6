"""Think is configured like a ModelAdmin: an attribute for the simple case, a get_*() behind it for the
dynamic one, hooks as methods, and mistakes reported by `manage.py check` with ids (Think.check)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from chat.agents import (
    ChatRecovery,
    ContextOverflow,
    Think,
    Tool,
    create_compact_function,
    tool,
)
from chat.checks import check_think_settings
from chat.handle import AgentHandle
from chat.turn.agent import recovery_config
from chat.turn.overflow import ChatErrorContext, classify
from chat.turn.registry import agent_class
from chat.turn.session import Session
from recovery.budget.incidents import ExhaustedContext, ProgressContext

ERROR_CONTEXT = ChatErrorContext(stage="stream", request_id="r")


@tool(parameters={"type": "object", "properties": {}})
def ping() -> str:
    """Answer pong."""
    return "pong"


def compact(messages: list[dict[str, Any]], ctx: Any) -> None:
    return None


class Plain(Think):
    model = "openai/gpt-plain"
    system_prompt = "Be brief."
    tools = [ping]
    chat_recovery = ChatRecovery(max_attempts=4)
    context_overflow = ContextOverflow(reactive=True)
    compaction = compact  # a plain function: not made a method of the agent


class Dynamic(Plain):
    def get_model(self) -> str:
        return f"openai/gpt-{self.name}"

    def get_system_prompt(self) -> str:
        return f"You serve {self.name}."

    def get_tools(self) -> list[Tool]:
        return [*super().get_tools(), ping]


def agent(cls: type[Think], name: str = "n") -> Think:
    return cls(agent="a", name=name)


def test_each_option_is_an_attribute_read_through_its_getter(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "MODEL": "openai/the-default"}
    plain = agent(Plain)

    assert plain.get_model() == "openai/gpt-plain"
    assert plain.get_system_prompt() == "Be brief."
    assert plain.get_tools() == [ping]
    assert plain.get_chat_recovery().max_attempts == 4
    assert plain.get_context_overflow() == ContextOverflow(reactive=True)
    assert plain.get_compaction() is compact
    assert agent(Think).get_model() == "openai/the-default", "no model attribute: THINK['MODEL']"
    assert agent(Think).get_chat_recovery() == ChatRecovery(), "True means the defaults"


def test_a_getter_decides_per_conversation() -> None:
    dynamic = agent(Dynamic, "acme")

    assert dynamic.get_model() == "openai/gpt-acme"
    assert dynamic.completion_kwargs() == {"model": "openai/gpt-acme"}
    assert dynamic.get_system_prompt() == "You serve acme."
    assert dynamic.get_tools() == [ping, ping]


def test_the_compaction_attribute_sets_the_session_up() -> None:
    session = agent(Plain).session

    assert isinstance(session, Session) and session.can_compact
    assert session._compaction is compact
    assert not agent(Think).session.can_compact


def test_a_configure_session_hook_still_registers_its_own_function() -> None:
    made = create_compact_function()

    class Hooked(Think):
        def configure_session(self, session: Session) -> None:
            session.on_compaction(made)

    assert agent(Hooked).session._compaction is made


def test_the_error_classifier_is_a_method_and_the_spec_assignment_still_works() -> None:
    from chat.agents import default_context_overflow_classifier

    class Method(Think):
        def classify_chat_error(self, error: Any, ctx: ChatErrorContext) -> str | None:
            return "fatal" if self.name == "strict" else super().classify_chat_error(error, ctx)

    class Assigned(Think):
        classify_chat_error = default_context_overflow_classifier

    overflow = RuntimeError("prompt is too long")
    assert classify(agent(Method, "strict"), overflow, stage="stream", request_id="r") == "fatal"
    assert classify(agent(Method), overflow, stage="stream", request_id="r") == "context_overflow"
    assert classify(agent(Assigned), overflow, stage="stream", request_id="r") == "context_overflow"
    assert Assigned.check() == []


def progress(attempt: int) -> ProgressContext:
    return ProgressContext(
        incident_id="i",
        request_id="r",
        recovery_root_request_id="r",
        attempt=attempt,
        max_attempts=10,
        recovery_kind="continue",
        work=0,
        age_ms=0,
    )


def test_the_recovery_hooks_are_methods_that_default_to_the_budgets_callables() -> None:
    seen: list[Any] = []
    budget = ChatRecovery(should_keep_recovering=lambda ctx: ctx.attempt < 3, on_exhausted=seen.append)

    class FromBudget(Think):
        chat_recovery = budget

    class FromMethods(Think):
        chat_recovery = budget

        def should_keep_recovering(self, ctx: ProgressContext) -> bool:
            return self.name == "patient"

        async def on_recovery_exhausted(self, ctx: ExhaustedContext) -> None:
            seen.append(("method", self.name))

    config = recovery_config(agent(FromBudget))
    assert config.max_attempts == budget.max_attempts
    assert config.should_keep_recovering is not None
    assert [config.should_keep_recovering(progress(n)) for n in (2, 3)] == [True, False]
    asyncio.run(config.on_exhausted("ctx"))  # type: ignore[misc, arg-type]
    assert seen == ["ctx"]

    patient = recovery_config(agent(FromMethods, "patient"))
    assert patient.should_keep_recovering is not None and patient.on_exhausted is not None
    assert patient.should_keep_recovering(progress(9)) is True
    assert recovery_config(agent(FromMethods)).should_keep_recovering(progress(2)) is False  # type: ignore[misc]
    asyncio.run(patient.on_exhausted("ctx"))  # type: ignore[arg-type]
    assert seen == ["ctx", ("method", "patient")]


class Misconfigured(Think):
    pass


@pytest.mark.parametrize(
    ("options", "error_id"),
    [
        ({"chat_stream_stall_timeout_ms": -1}, "think_chat.E012"),
        ({"chat_stream_stall_timeout_ms": True}, "think_chat.E012"),
        ({"max_steps": 0}, "think_chat.E013"),
        ({"message_concurrency": "merge"}, "think_chat.E014"),
        ({"chat_recovery": {"max_attempts": 3}}, "think_chat.E015"),
        ({"context_overflow": True}, "think_chat.E016"),
        ({"context_overflow": ContextOverflow(reactive=True)}, "think_chat.E017"),
        ({"compaction": "summarize"}, "think_chat.E018"),
        ({"tools": ping}, "think_chat.E019"),
        ({"tools": [ping, "lookup"]}, "think_chat.E019"),
        ({"model": ""}, "think_chat.E020"),
        ({"model": {"api_base": "http://x"}}, "think_chat.E020"),
        ({"system_prompt": ["Be brief."]}, "think_chat.E021"),
    ],
)
def test_a_mistaken_option_is_reported_with_its_id(options: dict[str, Any], error_id: str) -> None:
    cls = type("Wrong", (Think,), options)

    [error] = cls.check(label="wrong")

    assert error.id == error_id
    assert error.msg.startswith("Agent 'wrong' (Wrong): ") and error.obj is cls


def test_mistaken_hooks_are_reported_with_their_ids() -> None:
    class AsyncPredicate(Think):
        async def should_keep_recovering(self, ctx: ProgressContext) -> bool:  # type: ignore[override]
            return True

    def classify_by_text(error: Any, ctx: Any) -> str | None:
        return None

    class BoundClassifier(Think):
        classify_chat_error = classify_by_text  # type: ignore[assignment]

    assert [e.id for e in AsyncPredicate.check()] == ["think_chat.E022"]
    assert [e.id for e in BoundClassifier.check()] == ["think_chat.E023"]


def test_a_well_configured_agent_passes_and_overflow_with_a_session_hook_needs_no_attribute() -> None:
    class SessionHook(Think):
        context_overflow = ContextOverflow(reactive=True)

        def configure_session(self, session: Session) -> None:
            session.on_compaction(compact)

    assert Plain.check() == [] and Dynamic.check() == [] and SessionHook.check() == []


def test_manage_py_check_reports_a_registered_agents_mistakes_and_the_registry_refuses_it(
    settings: Any,
) -> None:
    settings.THINK = {
        **settings.THINK,
        "AGENTS": {
            "assistant": "thinkproject.agents.Assistant",
            "wrong": "tests.chat.turn.test_options.Broken",
        },
    }

    assert [m.id for m in check_think_settings()] == ["think_chat.E013"]
    with pytest.raises(ImproperlyConfigured, match=r"max_steps must be an int >= 1.*think_chat.E013"):
        agent_class("wrong")
    assert agent_class("assistant").check() == []


class Broken(Think):
    max_steps = 0


def test_open_agent_hands_out_the_conversation_and_think_keeps_only_options_and_hooks() -> None:
    for name in ("save_messages", "submit_messages", "continue_last_turn", "chat", "wait_until_stable"):
        assert hasattr(AgentHandle, name) and not hasattr(Think, name), name
