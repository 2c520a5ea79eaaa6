"""The demo's URLs, plus the React apps (tests/js/hook and tests/js/usechat, built by
tests/e2e/react_hook.py) served from the same origin, as a site serves its own front end. The useChat
app's page sets Django's CSRF cookie (`ensure_csrf_cookie`), as the view of a site's chat page would:
its POSTs send the token back."""

from django.urls import re_path
from django.views.decorators.csrf import ensure_csrf_cookie
from django.views.static import serve

from tests.hook_paths import HOOK_DIST, USECHAT_DIST
from tests.site_views import summarise
from thinkproject.urls import urlpatterns as demo_urlpatterns

urlpatterns = [
    re_path(r"^__hook__/(?P<path>.*)$", serve, {"document_root": HOOK_DIST}),
    re_path(r"^__usechat__/(?P<path>.*)$", ensure_csrf_cookie(serve), {"document_root": USECHAT_DIST}),
    re_path(r"^tickets/(?P<ticket>[0-9]+)/summary$", summarise),  # the README's own view
    *demo_urlpatterns,
]
