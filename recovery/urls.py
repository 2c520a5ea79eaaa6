"""URLs of the recovery app; a host includes them where it wants `/metrics` and `/healthz`."""

from django.urls import path

from . import health, views

app_name = "think_recovery"

urlpatterns = [
    path("metrics", views.metrics, name="metrics"),
    path("healthz", health.healthz, name="healthz"),
]
