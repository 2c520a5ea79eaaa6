"""HTTP views: the transcript endpoint the JS client loads, and the demo chat page."""

from __future__ import annotations

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import ensure_csrf_cookie
from django.views.decorators.http import require_GET

from .access import Credentials, access_policy, conversation_read
from .exceptions import AccessDenied, UnknownAgent
from .transcript.window import MAX_PAGE_MESSAGES, Window, transcript_window
from .turn.registry import agent_class, agent_names, conversation_name_problem, kebab


@require_GET
def get_messages(request: HttpRequest, agent: str, name: str) -> HttpResponse:
    """The transcript's window as a bare JSON array of UIMessages (empty for a conversation never used):
    its newest messages within THINK["TRANSCRIPT_WINDOW_BYTES"]; `?before=<message id>` pages back from a
    message, `&limit=N` (at most 1000) caps the count. The header `Think-Earlier: true` says older
    messages exist than the first (chat.transcript.window).

    Only for whoever may open the conversation (chat.access); anyone else gets 403 and no content.
    """
    try:
        agent_class(agent)
    except UnknownAgent:
        return JsonResponse({"error": f"unknown agent {agent!r}"}, status=404)
    problem = conversation_name_problem(name)
    if problem is not None:
        return JsonResponse({"error": problem}, status=400)
    credentials = Credentials.from_request(request)
    try:
        conversation = conversation_read(agent=agent, name=name, credentials=credentials)
    except AccessDenied as exc:
        return JsonResponse({"error": str(exc)}, status=403)
    limit = request.GET.get("limit")
    if limit is not None and not (limit.isdigit() and 0 < int(limit) <= MAX_PAGE_MESSAGES):
        return JsonResponse({"error": f"limit must be an integer from 1 to {MAX_PAGE_MESSAGES}"}, status=400)
    window = (
        transcript_window(
            conversation_id=conversation.pk,
            before=request.GET.get("before") or None,
            limit=int(limit) if limit is not None else None,
        )
        if conversation is not None
        else Window([], False)
    )
    response = JsonResponse(window.messages, safe=False)
    response["Think-Earlier"] = "true" if window.earlier else "false"
    return response


@require_GET
@ensure_csrf_cookie  # the page's uploads (chat.wire.files) send it back as X-CSRFToken
def index(request: HttpRequest) -> HttpResponse:
    """The chat page. Its socket carries the session cookie, so the visitor needs a session: a
    logged-in user, or (SessionAccess) an anonymous session made here; otherwise the login page."""
    policy = access_policy()
    credentials = Credentials.from_request(request)
    if policy.anonymous_sessions and credentials.session_key is None and hasattr(request, "session"):
        request.session["think_visitor"] = True  # an empty session would get no cookie
        request.session.save()
        credentials = Credentials.from_request(request)
    try:
        policy.principal(credentials)
    except AccessDenied:
        return redirect_to_login(request.get_full_path())
    agents = [kebab(name) for name in agent_names()]
    return render(
        request, "chat/index.html", {"agents": agents, "default_agent": agents[0] if agents else ""}
    )
