"""Celery tasks of the chat app: they take ids and call the turn runner."""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import CancelledError

from celery import shared_task
from celery.signals import task_failure, worker_process_init, worker_ready, worker_shutting_down

from recovery.lease import control
from recovery.process import runtime

from .conf import think_setting
from .transcript.turns import RUN_TURN

logger = logging.getLogger(__name__)


@shared_task(name=RUN_TURN, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_turn(fiber_id: str) -> None:
    """Run one turn. Safe to deliver twice: the fiber lease makes every delivery but one a no-op."""
    from .turn.runner import turn_run

    try:
        runtime.run(turn_run(fiber_id))
    except CancelledError:  # the worker is shutting down; the turn was handed to recovery
        logger.warning("turn of fiber %s cancelled by worker shutdown", fiber_id)


@worker_shutting_down.connect
def hand_turns_to_recovery(**kwargs: object) -> None:
    """A deploy or a stop: persist each running turn's partial and release its lease at once."""
    from .turn.runner import shutdown_all

    count = shutdown_all()
    if count:
        logger.warning("worker shutting down: %s running turns handed to recovery", count)


@worker_ready.connect
@worker_process_init.connect
def preload_litellm(**kwargs: object) -> None:
    """Import litellm in the background once the worker takes turns, if its agents' models need it
    (THINK["PRELOAD_LITELLM"]); a turn that needs it sooner waits for the same import. SIGUSR1 logs every
    running coroutine."""
    import signal
    import threading

    from .turn.llm import load_litellm

    with contextlib.suppress(ValueError):  # only possible from the main thread
        signal.signal(signal.SIGUSR1, lambda signum, frame: runtime.dump_tasks())
    policy = think_setting("PRELOAD_LITELLM")
    if policy is False or (policy == "auto" and not models_need_litellm()):
        logger.info("litellm is not preloaded: every agent's model is called without it")
        return
    threading.Thread(target=load_litellm, name="think-preload-litellm", daemon=True).start()


def models_need_litellm() -> bool:
    """Whether a turn of some registered agent may call litellm: a model that chat.turn.plain_openai does
    not call itself, or one an agent computes (get_model, completion_kwargs overridden), or the Responses
    API (model_reattach)."""
    from django.utils.module_loading import import_string

    from .turn.agent import Think
    from .turn.plain_openai import kwargs_qualify

    for path in (think_setting("AGENTS") or {}).values():
        try:
            cls = import_string(path)
        except ImportError:
            return True
        if not (isinstance(cls, type) and issubclass(cls, Think)):
            return True
        if (
            cls.get_model is not Think.get_model
            or cls.completion_kwargs is not Think.completion_kwargs
            or cls.model_reattach
            or not cls.lean_model_read
        ):
            return True
        model = cls.model if cls.model is not None else think_setting("MODEL")
        kwargs = {"model": model} if isinstance(model, str) else model
        if not (isinstance(kwargs, dict) and kwargs_qualify(kwargs)):
            return True
    return False


@worker_ready.connect
def listen_for_cancels(sender: object = None, **kwargs: object) -> None:
    """The process that runs the turns hears cancels at once (recovery.lease.control): the worker itself,
    unless a prefork pool runs them in its children (they start theirs as they start, below)."""
    from celery.concurrency.prefork import TaskPool as PreforkPool

    if not isinstance(getattr(sender, "pool", None), PreforkPool):
        control.start()


@worker_process_init.connect
def listen_for_cancels_in_child(**kwargs: object) -> None:
    control.start()


@task_failure.connect
def count_lost_workers(
    sender: object = None, exception: BaseException | None = None, args: object = None, **kwargs: object
) -> None:
    """A pool child that dies mid-turn (SIGKILL, the OOM killer) counts against the OOM budget."""
    from billiard.exceptions import WorkerLostError

    from recovery.lease.fibers import fiber_mark_worker_lost

    if getattr(sender, "name", None) != run_turn.name or not isinstance(exception, WorkerLostError):
        return
    if isinstance(args, list | tuple) and args:
        fiber_mark_worker_lost(fiber_id=args[0])
