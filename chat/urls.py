from django.urls import path

from . import views
from .wire import http

app_name = "think_chat"

urlpatterns = [
    path("", views.index, name="index"),
    path("agents/<str:agent>/<str:name>/get-messages", views.get_messages, name="get-messages"),
    # The AI SDK's HTTP chat wire (useChat's DefaultChatTransport, api "<mount>/ai/<agent>"): chat.wire.http.
    path("ai/<str:agent>", http.send, name="ai-send"),
    path("ai/<str:agent>/<str:name>/stream", http.rejoin, name="ai-stream"),
    path("ai/<str:agent>/<str:name>/stop", http.stop, name="ai-stop"),
]
