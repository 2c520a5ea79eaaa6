from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path


def home(request: HttpRequest) -> HttpResponse:
    return HttpResponse("The host site's own home page.")


urlpatterns = [
    path("", home, name="home"),
    path("admin/", admin.site.urls),
    path("support/", include("chat.urls")),
    path("ops/", include("recovery.urls")),
]
