from django.urls import path

from . import views
from .wire import files, http

app_name = "think_chat"

urlpatterns = [
    path("", views.index, name="index"),
    path("agents/<str:agent>/<str:name>/get-messages", views.get_messages, name="get-messages"),
    # The AI SDK's HTTP chat wire (useChat's DefaultChatTransport, api "<mount>/ai/<agent>"): chat.wire.http.
    path("ai/<str:agent>", http.send, name="ai-send"),
    path("ai/<str:agent>/<str:name>/stream", http.rejoin, name="ai-stream"),
    path("ai/<str:agent>/<str:name>/stop", http.stop, name="ai-stop"),
    # Files users attach (chat.wire.files): an upload for a conversation, a file served to its owner.
    path("files/<uuid:file_id>", files.serve, name="file"),
    path("files/<str:agent>/<str:name>", files.upload, name="file-upload"),
]
