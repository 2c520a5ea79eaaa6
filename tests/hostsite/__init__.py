"""A Django site that embeds the apps the way an existing site would (see settings.py).

As in any Celery + Django project, importing the site package loads its Celery app, so that web
processes send the apps' shared tasks through it.
"""

from .celery import app as celery_app

__all__ = ["celery_app"]
