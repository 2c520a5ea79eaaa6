"""URLs of the recovery app; a host includes them where it wants `/metrics`."""

from django.urls import path

from . import views

app_name = "think_recovery"

urlpatterns = [
    path("metrics", views.metrics, name="metrics"),
]
