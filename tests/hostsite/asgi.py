"""The host site's ASGI app: its own HTTP and WebSocket routing, with the chat routes under /support/."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.hostsite.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import path  # noqa: E402

from chat.routing import websocket_urlpatterns as chat_websocket_urlpatterns  # noqa: E402
from chat.wire.security import AllowedHostsBrowserOriginValidator  # noqa: E402

application = ProtocolTypeRouter(
    {
        # Static files for the test's browser; a real site serves them with WhiteNoise or its proxy.
        "http": ASGIStaticFilesHandler(django_asgi_app),
        "websocket": AllowedHostsBrowserOriginValidator(
            AuthMiddlewareStack(
                URLRouter(
                    [
                        # The same prefix as include("chat.urls") in urls.py: the page connects there.
                        path("support/", URLRouter(chat_websocket_urlpatterns)),
                        # ... the host's own WebSocket routes.
                    ]
                )
            )
        ),
    }
)
