"""The host site's own Celery app; the apps only declare shared tasks."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.hostsite.settings")

app = Celery("hostsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
