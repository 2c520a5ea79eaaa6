from django.apps import AppConfig


class ChatConfig(AppConfig):
    name = "chat"
    label = "think_chat"
    verbose_name = "Think chat"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from recovery.flusher import register_fanout

        from . import broadcast, checks  # noqa: F401

        # Every turn's frames of a flusher tick leave for the web processes together.
        register_fanout(broadcast.publish_frames_many)
