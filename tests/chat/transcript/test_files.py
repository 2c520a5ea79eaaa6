"""Files users attach (chat.transcript.files): kept in storage, checked, bounded, and given to the model."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from django.core.files.storage import default_storage

from chat.models import Branch, ChatFile, Conversation, Message
from chat.protocol import ChatRequest
from chat.transcript.files import Attachment, file_id_of, file_url
from chat.transcript.model_messages import to_model_messages
from chat.transcript.selectors import messages_list
from chat.transcript.turns import turn_accept, turn_start_programmatic
from chat.turn.llm import response_input
from recovery.models import Fiber
from tests.files import PDF, data_url, file_part, png

pytestmark = pytest.mark.django_db

PNG = png()


def user(message_id: str, *parts: dict[str, Any], text: str = "look") -> dict[str, Any]:
    return {"id": message_id, "role": "user", "parts": [{"type": "text", "text": text}, *parts]}


@pytest.fixture
def conversation() -> Conversation:
    return Conversation.objects.create(agent="assistant", name="files", owner="user:7")


def accept(conversation: Conversation, *messages: dict[str, Any], request_id: str = "r1") -> Any:
    request = ChatRequest(request_id, list(messages), "submit-message")
    return turn_accept(conversation_id=conversation.pk, request=request)


def stored_files(conversation: Conversation) -> list[ChatFile]:
    return list(ChatFile.objects.filter(conversation=conversation))


def storage_names() -> set[str]:
    root = Path(default_storage.location) / "think"
    return {p.name for p in root.iterdir()} if root.exists() else set()


def test_a_data_url_file_is_kept_in_storage_and_the_message_names_its_url(conversation: Conversation) -> None:
    accepted = accept(conversation, user("u1", file_part("image/png", PNG, "red.png")))
    assert not accepted.refused
    [row] = stored_files(conversation)
    assert (row.media_type, row.filename, row.size, row.owner) == ("image/png", "red.png", len(PNG), "user:7")
    with default_storage.open(row.storage_name) as handle:
        assert handle.read() == PNG
    [message] = messages_list(conversation_id=conversation.pk)
    assert message["parts"][1] == {
        "type": "file",
        "mediaType": "image/png",
        "url": file_url(row.id),
        "filename": "red.png",
    }
    assert "base64" not in str(Message.objects.get(message_id="u1").parts), "the bytes are not in the row"


def test_the_same_bytes_again_are_the_same_file_and_an_echo_is_not_an_edit(
    conversation: Conversation,
) -> None:
    """The AI SDK sends every message again with its data URLs: the echo finds the stored file."""
    first = user("u1", file_part("image/png", PNG))
    accept(conversation, first)
    Message.objects.create(
        conversation=conversation,
        message_id="a1",
        role="assistant",
        parts=[{"type": "text", "text": "red"}],
        position=1,
    )
    Fiber.objects.filter(conversation=conversation).update(status=Fiber.Status.COMPLETED)
    accepted = accept(conversation, first, {"id": "a1", "role": "assistant", "parts": []}, request_id="r2")
    assert not accepted.refused
    assert [m["id"] for m in messages_list(conversation_id=conversation.pk)] == ["u1", "a1"]
    assert not Branch.objects.filter(conversation=conversation).exists(), "the echo was not taken for an edit"
    accept(conversation, first, user("u2", file_part("image/png", PNG)), request_id="r3")
    assert len(stored_files(conversation)) == 1, "one file for one content"


def test_parts_with_the_same_bytes_keep_their_own_names_and_their_echo_is_not_an_edit(
    conversation: Conversation,
) -> None:
    named, unnamed = file_part("text/plain", b"same", "a.txt"), file_part("text/plain", b"same")
    accept(conversation, user("u1", named, unnamed))
    parts = messages_list(conversation_id=conversation.pk)[0]["parts"]
    assert [p.get("filename") for p in parts[1:]] == ["a.txt", None]
    Fiber.objects.filter(conversation=conversation).update(status=Fiber.Status.COMPLETED)
    assert not accept(conversation, user("u1", named, unnamed), request_id="r2").refused
    assert not Branch.objects.filter(conversation=conversation).exists()
    assert len(stored_files(conversation)) == 1


def test_a_regenerate_stores_no_file_of_the_message_it_does_not_change(conversation: Conversation) -> None:
    accept(conversation, user("u1", file_part("text/plain", b"first")))
    Fiber.objects.filter(conversation=conversation).update(status=Fiber.Status.COMPLETED)
    swapped = user("u1", file_part("text/plain", b"other bytes"))
    request = ChatRequest("r2", [swapped], "regenerate-message")
    assert not turn_accept(conversation_id=conversation.pk, request=request).refused
    assert [f.size for f in stored_files(conversation)] == [5]


def test_a_deleted_conversations_files_leave_the_storage(
    conversation: Conversation, django_capture_on_commit_callbacks: Any
) -> None:
    accept(conversation, user("u1", file_part("image/png", PNG)))
    [row] = stored_files(conversation)
    with django_capture_on_commit_callbacks(execute=True):
        conversation.delete()
    assert not default_storage.exists(row.storage_name)


def test_an_uploaded_files_url_is_accepted_for_its_own_conversation_only(conversation: Conversation) -> None:
    accept(conversation, user("u1", file_part("application/pdf", PDF, "doc.pdf")))
    [row] = stored_files(conversation)
    Fiber.objects.filter(conversation=conversation).update(status=Fiber.Status.COMPLETED)
    again = {"type": "file", "mediaType": "text/html", "url": file_url(row.id)}
    assert not accept(conversation, user("u2", again), request_id="r2").refused
    assert messages_list(conversation_id=conversation.pk)[-1]["parts"][1]["mediaType"] == "application/pdf"

    other = Conversation.objects.create(agent="assistant", name="other", owner="user:8")
    accepted = accept(other, user("x1", again), request_id="r3")
    assert "a file uploaded to this conversation" in accepted.refused
    assert not Message.objects.filter(conversation=other).exists()


@pytest.mark.parametrize(
    ("part", "says"),
    [
        (file_part("image/svg+xml", b"<svg onload='alert(1)'/>"), "'image/svg+xml' are not accepted"),
        (file_part("image/png", b"<html><script>alert(1)</script>"), "the bytes are not image/png"),
        (file_part("application/pdf", PNG), "the bytes are not application/pdf"),
        (file_part("image/webp", PNG), "not a WebP image"),
        (file_part("text/plain", b"nul\x00byte"), "NUL bytes"),
        (file_part("text/csv", b"\xff\xfe\x00"), "NUL bytes"),
        (file_part("text/plain", b"caf\xe9"), "must be UTF-8"),
        (file_part("text/plain", b""), "empty"),
        (
            {"type": "file", "mediaType": "image/png", "url": "data:image/png;base64,@@@@"},
            "base64 is not valid",
        ),
        ({"type": "file", "mediaType": "image/png", "url": "data:image/png,rawbytes"}, "data:<type>;base64"),
        ({**file_part("image/png", PNG), "mediaType": "image/gif"}, "its data URL says 'image/png'"),
        (
            {"type": "file", "mediaType": "image/png", "url": "https://evil.example/x.png"},
            "must be a data URL",
        ),
        ({"type": "file", "mediaType": "image/png", "url": "/chat/files/not-a-uuid"}, "must be a data URL"),
        ({"type": "file", "mediaType": "image/png"}, "needs a 'url'"),
        ({**file_part("image/png", PNG), "filename": "a\nb.png"}, "no control characters"),
        ({**file_part("image/png", PNG), "filename": "x" * 256}, "at most 255 characters"),
        ({**file_part("image/png", PNG), "filename": ["x"]}, "'filename' must be a string"),
    ],
)
def test_a_file_that_is_not_accepted_is_refused_and_nothing_is_stored(
    conversation: Conversation, part: dict[str, Any], says: str
) -> None:
    before = storage_names()
    accepted = accept(conversation, user("u1", part))
    assert says in accepted.refused and accepted.fiber_id is None
    assert not Message.objects.filter(conversation=conversation).exists()
    assert not stored_files(conversation) and storage_names() == before


def test_a_file_over_the_size_limit_is_refused_before_it_is_decoded(
    conversation: Conversation, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.THINK = {**settings.THINK, "MAX_FILE_BYTES": 1000}
    decoded: list[int] = []
    real = base64.b64decode
    monkeypatch.setattr(base64, "b64decode", lambda data, **kw: decoded.append(len(data)) or real(data, **kw))
    accepted = accept(conversation, user("u1", file_part("text/plain", b"a" * 1010)))
    assert "larger than 1000 bytes" in accepted.refused
    assert decoded == [], "refused from the data URL's length"
    accepted = accept(conversation, user("u1", file_part("text/plain", b"a" * 1001)))
    assert "the file is 1001 bytes; at most 1000 are accepted" in accepted.refused, "and exactly once decoded"
    assert not stored_files(conversation)
    assert not accept(conversation, user("u1", file_part("text/plain", b"a" * 1000))).refused


def test_a_message_carries_at_most_max_message_files(conversation: Conversation, settings: Any) -> None:
    settings.THINK = {**settings.THINK, "MAX_MESSAGE_FILES": 2}
    three = [file_part("text/plain", f"file {i}".encode()) for i in range(3)]
    accepted = accept(conversation, user("u1", *three))
    assert "carries 3 files; at most 2" in accepted.refused
    assert not stored_files(conversation)
    assert not accept(conversation, user("u1", *three[:2])).refused


def test_a_principals_file_bytes_of_the_day_are_bounded(conversation: Conversation, settings: Any) -> None:
    settings.THINK = {**settings.THINK, "PRINCIPAL_FILE_BYTES_PER_DAY": 150}
    assert not accept(conversation, user("u1", file_part("text/plain", b"a" * 100))).refused
    Fiber.objects.filter(conversation=conversation).update(status=Fiber.Status.COMPLETED)
    elsewhere = Conversation.objects.create(agent="assistant", name="files-2", owner="user:7")
    accepted = accept(elsewhere, user("u2", file_part("text/plain", b"b" * 100)), request_id="r2")
    assert "you have stored 100 bytes of files today" in accepted.refused
    assert not Message.objects.filter(conversation=elsewhere).exists()
    assert not accept(elsewhere, user("u2", file_part("text/plain", b"b" * 50)), request_id="r3").refused


def test_code_may_attach_files_to_a_programmatic_turn(conversation: Conversation) -> None:
    message = user("p1", file_part("image/png", PNG, "red.png"))
    turn_start_programmatic(conversation_id=conversation.pk, messages=[message], enqueue=False, timeout=5)
    [row] = stored_files(conversation)
    assert messages_list(conversation_id=conversation.pk)[0]["parts"][1]["url"] == file_url(row.id)
    Fiber.objects.filter(conversation=conversation).update(status=Fiber.Status.COMPLETED)
    bad = user("p2", file_part("image/svg+xml", b"<svg/>"))
    with pytest.raises(ValueError, match="are not accepted"):
        turn_start_programmatic(conversation_id=conversation.pk, messages=[bad], enqueue=False, timeout=5)
    assert len(messages_list(conversation_id=conversation.pk)) == 1


def test_the_model_gets_images_as_images_pdfs_as_files_and_text_as_text() -> None:
    ids = ["00000000-0000-4000-8000-00000000000" + str(i) for i in range(4)]
    files = {
        ids[0]: Attachment("image/png", PNG, "red.png"),
        ids[1]: Attachment("application/pdf", PDF, "doc.pdf"),
        ids[2]: Attachment("text/markdown", b"# Notes\nbuy milk", "notes.md"),
    }
    parts = [
        {"type": "file", "mediaType": "x", "url": f"/chat/files/{i}", "filename": f"f{n}"}
        for n, i in enumerate(ids)
    ]
    [message] = to_model_messages([user("u1", *parts, text="what is in these?")], files=files)
    assert message["content"] == [
        {"type": "text", "text": "what is in these?"},
        {"type": "image_url", "image_url": {"url": data_url("image/png", PNG)}},
        {"type": "file", "file": {"file_data": data_url("application/pdf", PDF), "filename": "f1"}},
        {"type": "text", "text": "[File f2 (text/markdown)]\n# Notes\nbuy milk"},
        {"type": "text", "text": "[The file f3 is no longer available.]"},
    ]
    assert to_model_messages([user("u2")])[0]["content"] == "look", "no files: plain text as before"

    _, items = response_input([message])
    assert items[0]["content"][:3] == [
        {"type": "input_text", "text": "what is in these?"},
        {"type": "input_image", "image_url": data_url("image/png", PNG)},
        {"type": "input_file", "file_data": data_url("application/pdf", PDF), "filename": "f1"},
    ]


def test_only_urls_of_the_file_view_name_a_file() -> None:
    file_id = "12345678-1234-4234-8234-123456789abc"
    assert str(file_id_of(f"/chat/files/{file_id}")) == file_id
    assert str(file_id_of(f"/site/chat/files/{file_id}?x=1")) == file_id
    for url in (f"https://evil.example/files/{file_id}", f"data:,/files/{file_id}", "/chat/files/1"):
        assert file_id_of(url) is None
