"""HTTP views: the transcript endpoint the JS client loads, and the demo chat page."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from .agents import UnknownAgent, agent_class, agent_names, kebab
from .selectors import conversation_get, messages_list


@require_GET
def get_messages(request: HttpRequest, agent: str, name: str) -> HttpResponse:
    """The transcript as a bare JSON array of UIMessages (empty for a conversation never used)."""
    try:
        agent_class(agent)
    except UnknownAgent:
        return JsonResponse({"error": f"unknown agent {agent!r}"}, status=404)
    conversation = conversation_get(agent=agent, name=name)
    messages = messages_list(conversation_id=conversation.pk) if conversation is not None else []
    return JsonResponse(messages, safe=False)


@require_GET
def index(request: HttpRequest) -> HttpResponse:
    agents = [kebab(name) for name in agent_names()]
    return render(
        request, "chat/index.html", {"agents": agents, "default_agent": agents[0] if agents else ""}
    )
