"""The demo site's agent: a short system prompt and two demo tools (one needs approval); the page adds
its client tools. Not part of the apps: a host site writes its own agents like this one."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field

from chat.agents import ContextOverflow, Proactive, RunContext, Think, create_compact_function, tool
from think_scripted import kwargs as scripted


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> dict[str, Any]:
    """The weather in a city (a demo: made up, but the same for the same city).

    Args:
        city: The city's name, e.g. "Paris".
        unit: The temperature's unit.
    """
    seed = sum(map(ord, city.lower()))
    celsius = seed % 35 - 5
    temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    return {"city": city, unit: temperature, "sky": ("clear", "cloudy", "rain", "snow")[seed % 4]}


@tool(needs_approval=True)
def send_email(
    ctx: RunContext,
    to: Annotated[str, Field(max_length=254, pattern=r"^[^@\s]+@[^@\s]+$")],
    subject: Annotated[str, Field(max_length=200)],
) -> str:
    """Send an email (a demo: a person approves each call, and nothing is really sent).

    Args:
        to: The recipient's address.
        subject: The subject line.
    """
    sender = ctx.user.get_username() if ctx.user is not None else (ctx.owner or "the site")
    return f"Email from {sender} to {to} about {subject!r} queued (demo: nothing was sent)."


def model_input_limit(model: str) -> int:
    """The demo model's input limit in tokens: THINK_MODEL_MAX_INPUT_TOKENS, else the scripted model's
    declared window when the demo talks to it, else 0 (unknown: only the provider's refusal tells)."""
    configured = os.environ.get("THINK_MODEL_MAX_INPUT_TOKENS", "").strip()
    if configured:
        return int(configured)
    return scripted.CONTEXT_WINDOW if model.endswith("/scripted") else 0


class Assistant(Think):
    """The demo agent: THINK["MODEL"] (the scripted model unless THINK_MODEL names another), a short system
    prompt, and two demo tools (one needs approval); the page adds its client tools. A long conversation
    is compacted (the middle summarised by the model) before its history nears the model's input limit,
    and again if the provider still refuses it as too long."""

    system_prompt = "You are a helpful assistant."
    tools = [get_weather, send_email]
    compaction = create_compact_function()

    def get_context_overflow(self) -> ContextOverflow:
        limit = model_input_limit(str(self.completion_kwargs()["model"]))
        proactive = Proactive(max_input_tokens=limit, before_first_step=True) if limit > 0 else None
        return ContextOverflow(reactive=True, proactive=proactive)
