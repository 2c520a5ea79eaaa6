from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


def refuse_unsafe_secret_key() -> None:
    """No process of a site with DEBUG off starts with a public or guessable SECRET_KEY: whoever knows
    the key signs a token for any user (think_chat.E026; `manage.py check --deploy` reports it always)."""
    if settings.DEBUG:
        return
    from .secret_key import HINT, secret_key_problems

    problems = secret_key_problems()
    if problems:
        raise ImproperlyConfigured(f"think_chat.E026: {' '.join(problems)} {HINT}")


class ChatConfig(AppConfig):
    name = "chat"
    label = "think_chat"
    verbose_name = "Think chat"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        refuse_unsafe_secret_key()
        from recovery.engine.alarms import register_callback
        from recovery.engine.detection import register_tick_sweep
        from recovery.engine.targets import register_target
        from recovery.stream.flusher import register_fanout

        from . import (
            broadcast,
            checks,  # noqa: F401
        )
        from .transcript import completions, submissions
        from .turn import continuation, deliveries, interrupted

        # Every turn's frames of a flusher tick leave for the web processes together.
        register_fanout(broadcast.publish_frames_many)
        # Durable submissions: the alarm that starts the next one, and the tick's sweep of them.
        register_callback(submissions.DRAIN_CALLBACK, submissions.drain_alarm)
        register_tick_sweep("submissions", submissions.submissions_sweep)
        # How turns end reaches turn_completed and on_turn_completed: after the commit that recorded it,
        # on that process; the tick delivers what a dead process left.
        completions.on_recorded(deliveries.deliver_soon, deliveries.heard)
        register_tick_sweep("completions", deliveries.completions_sweep)
        # Chat turns are the recovery layer's work: how an interrupted one is read, continued or retried,
        # and how clients hear of the outcome; the continue and retry alarms the engine schedules.
        register_target(interrupted.ChatTarget())
        register_callback(interrupted.CONTINUE_CALLBACK, continuation.continue_alarm)
        register_callback(interrupted.RETRY_CALLBACK, continuation.retry_alarm)
        # A file's row deleted (its conversation deleted): its bytes go from the storage once that commits.
        from django.db.models.signals import post_delete

        from .models import ChatFile
        from .transcript.files import file_deleted

        post_delete.connect(file_deleted, sender=ChatFile, dispatch_uid="think_chat_file_deleted")
