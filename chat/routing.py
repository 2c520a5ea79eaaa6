"""WebSocket routes; a host site mounts websocket_urlpatterns in its own ProtocolTypeRouter."""

from django.urls import re_path

from .wire.consumers import ChatConsumer

websocket_urlpatterns = [
    re_path(r"^agents/(?P<agent>[^/]+)/(?P<name>[^/]+)/?$", ChatConsumer.as_asgi()),  # type: ignore[arg-type]
]
