from django.apps import AppConfig


class ChatConfig(AppConfig):
    name = "chat"
    label = "think_chat"
    verbose_name = "Think chat"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from recovery.alarms import register_callback
        from recovery.dispatch import Dispatcher, register_dispatcher
        from recovery.flusher import register_fanout
        from recovery.tasks import register_tick_sweep

        from . import broadcast, checks, services, submissions, tasks  # noqa: F401

        # Every turn's frames of a flusher tick leave for the web processes together.
        register_fanout(broadcast.publish_frames_many)
        # Durable submissions: the alarm that starts the next one, and the tick's sweep of them.
        register_callback(submissions.DRAIN_CALLBACK, submissions.drain_alarm)
        register_tick_sweep("submissions", submissions.submissions_sweep)
        # Pending turns the tick sends again (a worker died after taking the task, before claiming it).
        register_dispatcher(
            Dispatcher(task_name=tasks.run_turn.name, enqueue_next=services.turn_enqueue_pending)
        )
