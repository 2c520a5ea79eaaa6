"""A read-only admin for conversations (with their transcript rendered), messages and submissions.

Everything a model or a user wrote is escaped (`format_html`), never marked safe. Hosts can
`admin.site.unregister(...)` any of these and register a subclass.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db.models import Count, F, OuterRef, Q, QuerySet, Subquery, Sum
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from recovery.admin import OperatorAdmin
from recovery.models import Fiber
from recovery.operations import actions

from .exceptions import ToolCallNotWaiting, UnknownAgent
from .handle import conversation_handle
from .models import Branch, Conversation, Message, PrincipalUsage, Submission, TokenRevocation, TurnCompletion
from .transcript.folding import is_tool_part, tool_name_of
from .transcript.selectors import messages_list
from .turn.actions import stop_conversation
from .types import Part, UIMessage

PRE = '<pre style="white-space: pre-wrap; margin: 2px 0 6px">{}</pre>'


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _approval_html(approval: dict[str, Any]) -> SafeString:
    if "approved" not in approval:
        state = "requested"
    else:
        state = "approved" if approval["approved"] else "denied"
    reason = approval.get("reason")
    return format_html(
        "<div>approval: <strong>{}</strong> <code>{}</code>{}</div>",
        state,
        approval.get("id", ""),
        format_html(" ({})", reason) if reason else "",
    )


def tool_part_html(part: Part) -> SafeString:
    """A tool call: name, call id, state, then its input, output, error and approval when present."""
    sections = [format_html("<div>input</div>" + PRE, _json(part.get("input")))]
    if "output" in part:
        sections.append(format_html("<div>output</div>" + PRE, _json(part["output"])))
    if part.get("errorText"):
        sections.append(format_html("<div>error</div>" + PRE, part["errorText"]))
    if isinstance(part.get("approval"), dict):
        sections.append(_approval_html(part["approval"]))
    return format_html(
        '<div style="border-left: 3px solid #79aec8; padding-left: 8px; margin: 4px 0">'
        "<strong>tool {}</strong> <code>{}</code> [{}]{}</div>",
        tool_name_of(part),
        part.get("toolCallId", ""),
        part.get("state", ""),
        format_html_join("", "{}", ((section,) for section in sections)),
    )


def part_html(part: Part) -> SafeString:
    kind = part.get("type")
    if kind == "text":
        return format_html(PRE, part.get("text", ""))
    if kind == "reasoning":
        return format_html("<div><em>reasoning</em></div>" + PRE, part.get("text", ""))
    if is_tool_part(part):
        return tool_part_html(part)
    if kind == "step-start":
        return format_html('<hr title="{}">', "step")
    return format_html("<div><em>{}</em></div>" + PRE, kind, _json(part))


def message_html(message: UIMessage) -> SafeString:
    """One UIMessage; a compaction overlay is labelled as the summary it is."""
    message_id = str(message.get("id", ""))
    label = "compaction summary" if message_id.startswith("compaction_") else message.get("role", "")
    parts = message.get("parts") or []
    return format_html(
        '<div style="margin-bottom: 12px">'
        '<h4 style="margin: 0">{} <small><code>{}</code></small></h4>{}</div>',
        label,
        message_id,
        format_html_join("", "{}", ((part_html(p),) for p in parts if isinstance(p, dict))),
    )


def transcript_html(messages: list[UIMessage]) -> SafeString:
    if not messages:
        return format_html("<em>{}</em>", "no messages")
    return format_html_join("", "{}", ((message_html(m),) for m in messages))


if TYPE_CHECKING:
    MessageInlineBase = admin.TabularInline[Message, Conversation]
else:  # Django's admin classes are generic only in django-stubs (see recovery.admin.OperatorAdmin)
    MessageInlineBase = admin.TabularInline


class MessageInline(MessageInlineBase):
    model = Message
    fields = ["position", "role", "message_id", "created_at"]
    readonly_fields = ["position", "role", "message_id", "created_at"]
    ordering = ["position"]
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Conversation | None = None) -> bool:
        return False

    # Inline permissions receive the parent object (the stubs' own definitions ignore this override too).
    def has_change_permission(  # type: ignore[override]
        self, request: HttpRequest, obj: Conversation | None = None
    ) -> bool:
        return False

    def has_delete_permission(  # type: ignore[override]
        self, request: HttpRequest, obj: Conversation | None = None
    ) -> bool:
        return False


@admin.register(Conversation)
class ConversationAdmin(OperatorAdmin[Conversation]):
    list_display = [
        "__str__",
        "agent",
        "name",
        "owner",
        "is_recovering",
        "open_incidents",
        "progress",
        "tokens",
        "cost",
        "updated_at",
    ]
    list_filter = ["agent"]
    search_fields = ["agent", "name", "owner"]
    date_hierarchy = "created_at"
    ordering = ["-updated_at"]
    fieldsets = [
        (None, {"fields": ["agent", "name", "owner", "created_at", "updated_at", "progress"]}),
        ("Recovery", {"fields": ["recovering", "last_terminal", "continue_armed", "tool_updates"]}),
        ("Transcript", {"fields": ["transcript"]}),
        ("Request context", {"fields": ["last_body", "last_client_tools"], "classes": ["collapse"]}),
    ]
    readonly_fields = ["created_at", "updated_at", "transcript"]
    inlines = [MessageInline]
    actions = [
        "stop_everything",
        "approve_waiting",
        "deny_waiting",
        "force_recover",
        "give_up",
        "clear_recovering",
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Conversation]:
        open_incidents = Q(incidents__status__in=actions.OPEN_INCIDENTS)
        fibers = Fiber.objects.filter(conversation=OuterRef("pk")).values("conversation")
        spent = fibers.annotate(t=Sum(F("input_tokens") + F("output_tokens"))).values("t")
        cost = fibers.annotate(c=Sum("cost")).values("c")
        return (
            super()
            .get_queryset(request)
            .annotate(
                open_total=Count("incidents", filter=open_incidents),
                tokens_total=Subquery(spent),
                cost_total=Subquery(cost),
            )
        )

    @admin.display(description="tokens (all turns)", ordering="tokens_total")
    def tokens(self, obj: Conversation) -> int:
        return int(getattr(obj, "tokens_total", None) or 0)

    @admin.display(description="cost (all turns)", ordering="cost_total")
    def cost(self, obj: Conversation) -> Any:
        return getattr(obj, "cost_total", None)

    @admin.display(description="recovering", boolean=True)
    def is_recovering(self, obj: Conversation) -> bool:
        return obj.recovering is not None

    @admin.display(description="open incidents", ordering="open_total")
    def open_incidents(self, obj: Conversation) -> int:
        return int(getattr(obj, "open_total", 0))

    @admin.display(description="transcript (as the model and clients see it)")
    def transcript(self, obj: Conversation) -> SafeString:
        return transcript_html(messages_list(conversation_id=obj.pk))

    @admin.action(description="Stop everything (turns, queue, approvals, recovery)", permissions=["operate"])
    def stop_everything(self, request: HttpRequest, queryset: QuerySet[Conversation]) -> None:
        reports = self.run_each(request, queryset.values_list("pk", flat=True), stop_conversation)
        turns = sum(len(r.request_ids) for r in reports)
        calls = sum(len(r.tool_calls) for r in reports)
        incidents = sum(len(r.incidents) for r in reports)
        self.message_user(
            request,
            f"Stopped {len(reports)} conversation(s): {turns} turn(s), {calls} waiting tool call(s), "
            f"{incidents} open incident(s).",
            messages.SUCCESS,
        )

    @admin.action(description="Approve the tool calls waiting for approval", permissions=["operate"])
    def approve_waiting(self, request: HttpRequest, queryset: QuerySet[Conversation]) -> None:
        self._decide_waiting(request, queryset, approved=True)

    @admin.action(description="Deny the tool calls waiting for approval", permissions=["operate"])
    def deny_waiting(self, request: HttpRequest, queryset: QuerySet[Conversation]) -> None:
        self._decide_waiting(request, queryset, approved=False)

    def _decide_waiting(
        self, request: HttpRequest, queryset: QuerySet[Conversation], *, approved: bool
    ) -> None:
        """Each waiting call through AgentHandle.approve / deny: the path of a client's approval."""
        reason = "denied by an operator"

        def decide(pk: int) -> list[str]:
            try:
                handle = conversation_handle(pk)
            except (UnknownAgent, Conversation.DoesNotExist) as exc:
                self.message_user(request, f"conversation {pk}: {exc!r}", messages.WARNING)
                return []
            decided = []
            for call in handle.waiting_approvals():
                try:
                    if approved:
                        handle.approve(call["toolCallId"])
                    else:
                        handle.deny(call["toolCallId"], reason)
                except ToolCallNotWaiting as exc:  # decided by someone else meanwhile
                    self.message_user(request, str(exc), messages.WARNING)
                    continue
                decided.append(call["toolCallId"])
            return decided

        done = self.run_each(request, queryset.values_list("pk", flat=True), decide)
        verb = "Approved" if approved else "Denied"
        self.message_user(request, f"{verb} {sum(len(d) for d in done)} tool call(s).", messages.SUCCESS)

    @admin.action(description="Force recovery now", permissions=["operate"])
    def force_recover(self, request: HttpRequest, queryset: QuerySet[Conversation]) -> None:
        forced = self.run_each(
            request,
            queryset.values_list("pk", flat=True),
            lambda pk: actions.conversation_force_recover(conversation_id=pk),
        )
        total = sum(len(ids) for ids in forced)
        self.message_user(request, f"{total} fiber(s) handed to recovery.", messages.SUCCESS)

    @admin.action(description="Give up now", permissions=["operate"])
    def give_up(self, request: HttpRequest, queryset: QuerySet[Conversation]) -> None:
        counts = self.run_each(
            request,
            queryset.values_list("pk", flat=True),
            lambda pk: actions.conversation_give_up(conversation_id=pk),
        )
        self.message_user(
            request,
            f"Gave up on {sum(counts)} open incident(s); the terminal message was sent.",
            messages.SUCCESS,
        )

    @admin.action(description="Clear recovering flag", permissions=["operate"])
    def clear_recovering(self, request: HttpRequest, queryset: QuerySet[Conversation]) -> None:
        cleared = self.run_each(
            request,
            queryset.values_list("pk", flat=True),
            lambda pk: actions.conversation_clear_recovering(conversation_id=pk),
        )
        self.message_user(
            request, f"Cleared the recovering flag of {sum(cleared)} conversation(s).", messages.SUCCESS
        )


@admin.register(Message)
class MessageAdmin(OperatorAdmin[Message]):
    list_display = ["message_id", "conversation", "position", "role", "created_at"]
    list_filter = ["role", "conversation__agent"]
    list_select_related = ["conversation"]
    search_fields = ["message_id", "conversation__name"]
    ordering = ["-created_at"]
    fields = ["conversation", "message_id", "role", "position", "created_at", "updated_at", "rendered"]
    readonly_fields = ["created_at", "updated_at", "rendered"]

    @admin.display(description="parts")
    def rendered(self, obj: Message) -> SafeString:
        return message_html(obj.as_ui_message())


@admin.register(Submission)
class SubmissionAdmin(OperatorAdmin[Submission]):
    list_display = [
        "submission_id",
        "conversation",
        "status",
        "idempotency_key",
        "created_at",
        "started_at",
        "finished_at",
    ]
    list_filter = ["status", "conversation__agent"]
    list_select_related = ["conversation"]
    search_fields = ["submission_id", "idempotency_key", "request_id", "conversation__name"]
    date_hierarchy = "created_at"
    ordering = ["-created_at"]


@admin.register(Branch)
class BranchAdmin(OperatorAdmin[Branch]):
    """Branches set aside by a regenerate or an edit (the branch in use is the conversation's messages)."""

    list_display = ["__str__", "conversation", "anchor_message_id", "first_created_at", "created_at"]
    list_filter = ["conversation__agent"]
    list_select_related = ["conversation"]
    search_fields = ["anchor_message_id", "conversation__name"]
    ordering = ["-created_at"]
    fields = ["conversation", "anchor_message_id", "first_created_at", "created_at", "rendered"]
    readonly_fields = ["created_at", "rendered"]

    @admin.display(description="messages")
    def rendered(self, obj: Branch) -> SafeString:
        return transcript_html(list(obj.messages))


@admin.register(TurnCompletion)
class TurnCompletionAdmin(OperatorAdmin[TurnCompletion]):
    """How each turn ended, and whether turn_completed and on_turn_completed have heard of it."""

    list_display = [
        "request_id",
        "conversation",
        "ending",
        "message_id",
        "created_at",
        "delivered_at",
        "attempts",
    ]
    list_filter = ["ending", "conversation__agent"]
    list_select_related = ["conversation"]
    search_fields = ["request_id", "last_request_id", "conversation__name"]
    date_hierarchy = "created_at"
    ordering = ["-created_at"]


@admin.register(PrincipalUsage)
class PrincipalUsageAdmin(OperatorAdmin[PrincipalUsage]):
    """What each principal started and spent per day, and their turns running now (THINK limits)."""

    list_display = ["principal", "day", "turns", "input_tokens", "output_tokens", "active_turns"]
    list_filter = ["day"]
    search_fields = ["principal"]
    date_hierarchy = "day"

    @admin.display(description="queued or running now")
    def active_turns(self, obj: PrincipalUsage) -> int:
        return Fiber.objects.filter(conversation__owner=obj.principal).active().count()


@admin.register(TokenRevocation)
class TokenRevocationAdmin(OperatorAdmin[TokenRevocation]):
    """Revoked access tokens (chat.tokens); `manage.py think_token --revoke` / `--revoke-all` adds them."""

    list_display = ["__str__", "token_id", "principal", "not_before", "created_at"]
    search_fields = ["token_id", "principal"]
    ordering = ["-created_at"]
