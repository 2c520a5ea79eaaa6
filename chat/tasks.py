"""Celery tasks of the chat app: they take ids and call the turn runner."""

from __future__ import annotations

from celery import shared_task

from recovery import runtime


@shared_task(name="think.run_turn", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_turn(fiber_id: str) -> None:
    """Run one turn. Safe to deliver twice: the fiber lease makes every delivery but one a no-op."""
    from .turns import turn_run

    runtime.run(turn_run(fiber_id))
