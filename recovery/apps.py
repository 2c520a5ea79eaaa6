from django.apps import AppConfig


class RecoveryConfig(AppConfig):
    name = "recovery"
    label = "think_recovery"
    verbose_name = "Think recovery"
    default_auto_field = "django.db.models.BigAutoField"
