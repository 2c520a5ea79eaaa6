"""The Celery app of the demo site; the reusable apps only declare shared tasks."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "thinkproject.settings")
# litellm fetches its cost map over the network at import unless told otherwise.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

app = Celery("thinkproject")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
