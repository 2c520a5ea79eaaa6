from django.apps import AppConfig


class RecoveryConfig(AppConfig):
    name = "recovery"
    label = "think_recovery"
    verbose_name = "Think recovery"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks, metrics, signals  # noqa: F401  (checks registers the system checks)

        # Turn and recovery counts come from the diagnostic events.
        signals.chat_event.connect(metrics.chat_event_observed, dispatch_uid="think_recovery.metrics")
