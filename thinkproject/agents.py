"""The demo site's agent: a short system prompt and two demo tools (one needs approval); the page adds
its client tools. Not part of the apps: a host site writes its own agents like this one."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from chat.agents import RunContext, Think, tool


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


class Assistant(Think):
    """The demo agent: THINK["MODEL"] (the scripted model unless THINK_MODEL names another), a short system
    prompt, and two demo tools (one needs approval); the page adds its client tools."""

    system_prompt = "You are a helpful assistant."
    tools = [get_weather, send_email]
