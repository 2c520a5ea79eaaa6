"""Uploads and serving of files (chat.wire.files), and the bound on request bodies (chat.wire.bodies)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse

from chat.models import ChatFile, Conversation
from chat.wire.bodies import BodyLimit
from tests.files import PDF, png
from tests.support import TEST_PRINCIPAL, auth_headers

# The views run their database work on the shared pool's threads: committed data only.
pytestmark = pytest.mark.django_db(transaction=True)

PNG = png()
UPLOAD = reverse("think_chat:file-upload", args=["assistant", "files-http"])


def upload(client: Client, name: str, media_type: str, data: bytes, url: str = UPLOAD, **headers: Any) -> Any:
    return client.post(
        url, {"file": SimpleUploadedFile(name, data, content_type=media_type)}, headers=headers
    )


def test_an_upload_answers_a_file_part_whose_url_serves_the_bytes_to_the_owner_only() -> None:
    client = Client()
    answer = upload(client, "red.png", "image/png", PNG, **auth_headers())
    assert answer.status_code == 201, answer.content
    part = answer.json()
    row = ChatFile.objects.get()
    assert part == {
        "type": "file",
        "mediaType": "image/png",
        "url": reverse("think_chat:file", args=[row.id]),
        "filename": "red.png",
    }
    assert Conversation.objects.get(pk=row.conversation_id).owner == TEST_PRINCIPAL

    served = client.get(part["url"], headers=auth_headers())
    assert served.status_code == 200 and b"".join(served.streaming_content) == PNG
    assert served["Content-Type"] == "image/png"
    assert served["X-Content-Type-Options"] == "nosniff"
    assert served["Content-Security-Policy"].startswith("sandbox")

    for headers in (auth_headers("test:someone-else"), {}):
        refused = client.get(part["url"], headers=headers)
        assert refused.status_code == 404 and b"PNG" not in refused.content
    assert upload(client, "again.png", "image/png", PNG, **auth_headers()).json()["url"] == part["url"]
    assert ChatFile.objects.count() == 1


def test_a_pdf_is_served_as_an_attachment() -> None:
    client = Client()
    part = upload(client, "doc.pdf", "application/pdf", PDF, **auth_headers()).json()
    served = client.get(part["url"], headers=auth_headers())
    assert (
        served["Content-Disposition"].startswith("attachment")
        and 'filename="doc.pdf"' in served["Content-Disposition"]
    )


@pytest.mark.parametrize(
    ("name", "media_type", "data", "status", "says"),
    [
        ("evil.svg", "image/svg+xml", b"<svg onload='alert(1)'/>", 415, "'image/svg+xml' are not accepted"),
        (
            "evil.png",
            "image/png",
            b"<html><script>alert(1)</script></html>",
            415,
            "the bytes are not image/png",
        ),
        ("big.txt", "text/plain", b"a" * 1001, 413, "larger than the 1000 bytes"),
        ("empty.txt", "text/plain", b"", 400, "empty"),
    ],
)
def test_an_upload_that_is_not_accepted_is_refused_and_nothing_is_kept(
    settings: Any, name: str, media_type: str, data: bytes, status: int, says: str
) -> None:
    settings.THINK = {**settings.THINK, "MAX_FILE_BYTES": 1000}
    refused = upload(Client(), name, media_type, data, **auth_headers())
    assert refused.status_code == status and says in refused.content.decode()
    assert not ChatFile.objects.exists()


def test_a_body_declared_over_the_limit_is_refused_before_the_view(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "MAX_FILE_BYTES": 1000}
    refused = Client().post(
        UPLOAD,
        data=b"x",
        content_type="multipart/form-data; boundary=b",
        headers={**auth_headers(), "Content-Length": str(10**9)},
    )
    assert refused.status_code == 413 and "larger than the 1000 bytes" in refused.content.decode()


def test_an_upload_with_a_cookie_needs_the_csrf_token() -> None:
    user = get_user_model().objects.create_user("uploader")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert upload(client, "a.txt", "text/plain", b"hello").status_code == 403
    client.get(reverse("think_chat:index"))  # the page sets the csrftoken cookie
    token = client.cookies["csrftoken"].value
    assert upload(client, "a.txt", "text/plain", b"hello", **{"X-CSRFToken": token}).status_code == 201


def test_a_principals_uploads_are_bounded_per_day(settings: Any) -> None:
    settings.THINK = {**settings.THINK, "PRINCIPAL_FILE_BYTES_PER_DAY": 150}
    client = Client()
    assert upload(client, "a.txt", "text/plain", b"a" * 100, **auth_headers()).status_code == 201
    refused = upload(client, "b.txt", "text/plain", b"b" * 100, **auth_headers())
    assert refused.status_code == 429 and "stored 100 bytes of files today" in refused.content.decode()
    assert ChatFile.objects.count() == 1


def test_anonymous_visitors_files_are_bounded_per_address(settings: Any) -> None:
    """A new cookie is a new principal: an anonymous visitor's bytes also count against the address."""
    settings.THINK = {
        **settings.THINK,
        "ACCESS_POLICY": "chat.access.SessionAccess",
        "PRINCIPAL_FILE_BYTES_PER_DAY": None,
        "ANONYMOUS_FILE_BYTES_PER_DAY_PER_ADDRESS": 150,
    }
    answers, address = [], f"192.0.2.{uuid.uuid4().int % 250}"
    for tag in ("first", "second"):  # two visitors, one address
        visitor = Client(enforce_csrf_checks=True, REMOTE_ADDR=address)
        visitor.get(reverse("think_chat:index"))
        token = visitor.cookies["csrftoken"].value
        url = reverse("think_chat:file-upload", args=["assistant", f"files-{tag}"])  # each their own
        answers.append(
            upload(visitor, f"{tag}.txt", "text/plain", tag.encode() * 20, url, **{"X-CSRFToken": token})
        )
    assert answers[0].status_code == 201
    assert (
        answers[1].status_code == 429
        and "from your address without signing in" in answers[1].content.decode()
    )
    assert ChatFile.objects.count() == 1


def test_body_limit_stops_reading_a_body_past_the_limit(settings: Any) -> None:
    """A body without Content-Length (chunked) is counted as it arrives: past the limit nothing more is
    read (the application's read of it fails) and the answer is 413."""
    settings.THINK = {**settings.THINK, "MAX_FILE_BYTES": 1000, "MAX_FRAME_BYTES": 1000}
    reads, sent = 0, []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 10_000, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def application(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    asyncio.run(BodyLimit(application)(scope, receive, send))
    assert sent[0]["status"] == 413 and reads <= 12, "stopped within the limit and its multipart envelope"
