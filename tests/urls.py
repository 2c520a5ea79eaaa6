"""The demo's URLs, plus the React hook app (tests/js/hook, built by tests/e2e/react_hook.py) served
from the same origin, as a site serves its own front end."""

from django.urls import re_path
from django.views.static import serve

from tests.hook_paths import HOOK_DIST
from thinkproject.urls import urlpatterns as demo_urlpatterns

urlpatterns = [
    re_path(r"^__hook__/(?P<path>.*)$", serve, {"document_root": HOOK_DIST}),
    *demo_urlpatterns,
]
