"""URLs of the recovery app; a host includes them where it wants `/metrics` and `/healthz`."""

from django.urls import path

from recovery import views
from recovery.operations import health

app_name = "think_recovery"

urlpatterns = [
    path("metrics", views.metrics, name="metrics"),
    path("healthz", health.healthz, name="healthz"),
]
