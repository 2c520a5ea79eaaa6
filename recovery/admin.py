"""A read-only admin for fibers, streams, incidents and faults; changes happen only through the
operator actions.

Hosts can `admin.site.unregister(...)` any of these and register a subclass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Generic, TypeVar

from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.db.models import Count, Model, QuerySet
from django.http import HttpRequest
from django.utils.timesince import timesince

from recovery.models import Fault, Fiber, Incident, Stream
from recovery.operations import actions

M = TypeVar("M", bound=Model)
T = TypeVar("T")
R = TypeVar("R")


# Generic through typing.Generic, not admin.ModelAdmin[M]: Django's admin classes are generic only in
# django-stubs, and subscripting them at run time needs django_stubs_ext.monkeypatch(), which a host
# site need not call.
class OperatorAdmin(admin.ModelAdmin, Generic[M]):
    """Nothing is added, edited or deleted here; staff with the change permission may run the actions."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: M | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: M | None = None) -> bool:
        return False

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Checked for actions declared with `permissions=["operate"]`."""
        codename = get_permission_codename("change", self.opts)
        return request.user.has_perm(f"{self.opts.app_label}.{codename}")

    def run_each(self, request: HttpRequest, items: Iterable[T], operation: Callable[[T], R]) -> list[R]:
        """Run an operation per selected item; refusals are reported, the other results returned."""
        results: list[R] = []
        for item in items:
            try:
                results.append(operation(item))
            except (actions.OperationRefused, ValueError) as exc:
                self.message_user(request, str(exc), messages.WARNING)
        return results


@admin.register(Fiber)
class FiberAdmin(OperatorAdmin[Fiber]):
    list_display = [
        "id",
        "conversation",
        "request_id",
        "kind",
        "status",
        "interruption",
        "lease_owner",
        "lease_expires_at",
        "fencing",
        "input_tokens",
        "output_tokens",
        "cached_tokens",
        "cost",
        "age",
    ]
    list_filter = ["status", "kind", "interruption", "conversation__agent"]
    list_select_related = ["conversation"]
    search_fields = ["id", "request_id", "conversation__name", "lease_owner"]
    date_hierarchy = "created_at"
    ordering = ["-created_at"]
    actions = ["force_recover"]

    @admin.display(description="age", ordering="created_at")
    def age(self, obj: Fiber) -> str:
        return timesince(obj.created_at)

    @admin.action(description="Force recovery now", permissions=["operate"])
    def force_recover(self, request: HttpRequest, queryset: QuerySet[Fiber]) -> None:
        forced = self.run_each(
            request,
            queryset.values_list("pk", flat=True),
            lambda pk: actions.fiber_force_recover(fiber_id=pk),
        )
        self.message_user(request, f"{len(forced)} fiber(s) handed to recovery.", messages.SUCCESS)


@admin.register(Stream)
class StreamAdmin(OperatorAdmin[Stream]):
    list_display = [
        "id",
        "conversation",
        "request_id",
        "message_id",
        "status",
        "is_continuation",
        "segment_count",
        "created_at",
        "completed_at",
    ]
    list_filter = ["status", "is_continuation", "conversation__agent"]
    list_select_related = ["conversation"]
    search_fields = ["id", "request_id", "message_id", "conversation__name"]
    date_hierarchy = "created_at"
    ordering = ["-created_at"]
    readonly_fields = ["segment_count"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Stream]:
        return super().get_queryset(request).annotate(segment_total=Count("segments"))

    @admin.display(description="segments", ordering="segment_total")
    def segment_count(self, obj: Stream) -> int:
        return int(getattr(obj, "segment_total", 0))


@admin.register(Incident)
class IncidentAdmin(OperatorAdmin[Incident]):
    list_display = [
        "incident_id",
        "conversation",
        "status",
        "reason",
        "recovery_kind",
        "attempts",
        "first_seen",
        "last_attempt",
        "spent_tokens",
        "spent_cost",
        "updated_at",
    ]
    list_filter = ["reason", "status", "conversation__agent"]
    list_select_related = ["conversation"]
    search_fields = ["incident_id", "request_id", "conversation__name"]
    date_hierarchy = "updated_at"
    ordering = ["-updated_at"]
    # Times are epoch milliseconds in the table; the page shows them as datetimes instead.
    exclude = ["first_seen_at", "last_attempt_at", "last_progress_at"]
    readonly_fields = ["attempts", "first_seen", "last_attempt", "last_progress"]
    actions = ["give_up"]

    @admin.display(description="attempts")
    def attempts(self, obj: Incident) -> str:
        return f"{obj.attempt} / {obj.max_attempts}"

    @admin.display(description="first seen", ordering="first_seen_at")
    def first_seen(self, obj: Incident) -> datetime | None:
        return actions.epoch_ms_datetime(obj.first_seen_at)

    @admin.display(description="last attempt", ordering="last_attempt_at")
    def last_attempt(self, obj: Incident) -> datetime | None:
        return actions.epoch_ms_datetime(obj.last_attempt_at)

    @admin.display(description="last progress", ordering="last_progress_at")
    def last_progress(self, obj: Incident) -> datetime | None:
        return actions.epoch_ms_datetime(obj.last_progress_at)

    @admin.action(description="Give up now", permissions=["operate"])
    def give_up(self, request: HttpRequest, queryset: QuerySet[Incident]) -> None:
        given_up = self.run_each(
            request,
            queryset.values_list("pk", flat=True),
            lambda pk: actions.incident_give_up(incident_pk=pk),
        )
        self.message_user(
            request,
            f"Gave up on {len(given_up)} incident(s); the terminal message was sent.",
            messages.SUCCESS,
        )


@admin.register(Fault)
class FaultAdmin(OperatorAdmin[Fault]):
    """The details behind a public "error 3f2a9c1e": search for those 8 digits."""

    list_display = ["reference", "created_at", "kind", "error_class", "conversation", "request_id"]
    list_filter = ["kind", "conversation__agent"]
    list_select_related = ["conversation"]
    search_fields = ["id", "request_id", "error_class", "conversation__name"]
    date_hierarchy = "created_at"
    ordering = ["-created_at"]
    readonly_fields = ["reference"]

    @admin.display(description="reference")
    def reference(self, obj: Fault) -> str:
        return obj.reference
