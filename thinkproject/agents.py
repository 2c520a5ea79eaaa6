"""The demo site's agent: a short system prompt and two demo tools (one needs approval); the page adds
its client tools. Not part of the apps: a host site writes its own agents like this one."""

from __future__ import annotations

from typing import Any

from chat.agents import Think, tool


@tool(parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
def get_weather(city: str) -> dict[str, Any]:
    """The weather in a city (a demo: made up, but the same for the same city)."""
    seed = sum(map(ord, city.lower()))
    return {"city": city, "celsius": seed % 35 - 5, "sky": ("clear", "cloudy", "rain", "snow")[seed % 4]}


@tool(
    parameters={
        "type": "object",
        "properties": {"to": {"type": "string"}, "subject": {"type": "string"}},
        "required": ["to", "subject"],
    },
    needs_approval=True,
)
def send_email(to: str, subject: str) -> str:
    """Send an email (a demo: a person approves each call, and nothing is really sent)."""
    return f"Email to {to} about {subject!r} queued (demo: nothing was sent)."


class Assistant(Think):
    """The demo agent: THINK["MODEL"] (the scripted model unless THINK_MODEL names another), a short system
    prompt, and two demo tools (one needs approval); the page adds its client tools."""

    system_prompt = "You are a helpful assistant."
    tools = [get_weather, send_email]
