"""ASGI entry point: HTTP through Django, WebSockets through the chat consumer."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "thinkproject.settings")
django_asgi_app = get_asgi_application()

# Consumers import models, so they come after the app registry is ready.
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from chat.routing import websocket_urlpatterns  # noqa: E402
from chat.wire.auth import AuthMiddlewareStack  # noqa: E402
from chat.wire.bodies import BodyLimit  # noqa: E402
from chat.wire.security import AllowedHostsBrowserOriginValidator  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": BodyLimit(django_asgi_app),
        "websocket": AllowedHostsBrowserOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))  # type: ignore[arg-type]
        ),
    }
)
