"""The thinkproject demo site: settings, ASGI app, URL conf and the Celery app. No domain logic."""

from .celery import app as celery_app

__all__ = ["celery_app"]
