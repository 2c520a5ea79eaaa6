from django.apps import AppConfig


class RecoveryConfig(AppConfig):
    name = "recovery"
    label = "think_recovery"
    verbose_name = "Think recovery"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from recovery import (
            checks,  # noqa: F401  (checks registers the system checks)
            signals,
        )
        from recovery.observe import metrics
        from recovery.stream import buffer, flusher

        buffer.register_group_commit(flusher.flusher)

        # Turn and recovery counts come from the diagnostic events.
        signals.chat_event.connect(metrics.chat_event_observed, dispatch_uid="think_recovery.metrics")
