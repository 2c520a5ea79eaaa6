from django.urls import path

from . import views

app_name = "think_chat"

urlpatterns = [
    path("", views.index, name="index"),
    path("agents/<str:agent>/<str:name>/get-messages", views.get_messages, name="get-messages"),
]
