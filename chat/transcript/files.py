"""Files a user attaches to a message: the AI SDK's `file` parts, kept in Django's storage.

A client sends a file part (`{"type": "file", "mediaType", "filename", "url"}`) with its bytes inline,
as a `data:` URL (what the AI SDK's `useChat` makes of a FileList), or with the URL an upload returned
(`chat.wire.files`, for files too big for a chat request). Either way the server keeps the bytes in
`default_storage`, one `ChatFile` per distinct content of a conversation, and the stored message holds
the file's own URL (`think_chat:file`), served to whoever may open the conversation and nobody else.

Every file is checked before anything is stored: its type is one of THINK["FILE_TYPES"] and its bytes
are what that type says (a PNG starts as PNGs do, a text file is UTF-8 without NULs), it is at most
THINK["MAX_FILE_BYTES"], a message carries at most THINK["MAX_MESSAGE_FILES"], and its owner stores at
most THINK["PRINCIPAL_FILE_BYTES_PER_DAY"] a UTC day. A file part may not point anywhere else: the model
is never handed a URL to fetch.

The same content sent again (the AI SDK echoes every message with its data URLs in each request) finds
the file it already is, so an echo equals the stored message and is never taken for an edit.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import connection, transaction
from django.db.models import Sum
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from ..caching import shared_cache
from ..conf import think_setting
from ..exceptions import FileRefused
from ..models import ChatFile
from ..types import Part, UIMessage
from .quotas import ANONYMOUS_PREFIX
from .services import conversation_lock

_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)((?:;[\w.+-]+=[^;,]*)*);base64,", re.ASCII)
_FILE_ID = re.compile(r"/files/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/?$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_FILENAME = 255
TEXT_TYPES = ("text/",)

# What the first bytes of each binary type are; text types are UTF-8 without NULs instead.
_MAGIC: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/gif": (b"GIF87a", b"GIF89a"),
    "application/pdf": (b"%PDF-",),
}


def _is_webp(data: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def content_problem(media_type: str, data: bytes) -> str | None:
    """Why these bytes are not a file of `media_type` (None when they are, or the type is not known)."""
    if media_type == "image/webp":
        return None if _is_webp(data) else "the bytes are not a WebP image"
    magic = _MAGIC.get(media_type)
    if magic is not None:
        return None if data.startswith(magic) else f"the bytes are not {media_type}"
    if media_type.startswith(TEXT_TYPES) or media_type == "application/json":
        if b"\x00" in data:
            return "a text file must not contain NUL bytes"
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return "a text file must be UTF-8"
    return None


def check_file(media_type: str, data: bytes) -> None:
    """Raise FileRefused unless `data` may be kept as a file of `media_type` (its type, size, bytes)."""
    allowed = think_setting("FILE_TYPES")
    if media_type not in allowed:
        raise FileRefused(
            f"files of type {media_type!r} are not accepted (accepted: {', '.join(allowed)})", 415
        )
    most = think_setting("MAX_FILE_BYTES")
    if len(data) > most:
        raise FileRefused(f"the file is {len(data)} bytes; at most {most} are accepted", 413)
    if not data:
        raise FileRefused("the file is empty", 400)
    problem = content_problem(media_type, data)
    if problem is not None:
        raise FileRefused(f"declared {media_type}, but {problem}", 415)


def parse_data_url(url: str) -> tuple[str, bytes]:
    """The media type and bytes of a base64 `data:` URL; FileRefused when it is not one, or is over
    THINK["MAX_FILE_BYTES"] (judged from its length, before anything is decoded)."""
    match = _DATA_URL.match(url)
    if match is None:
        raise FileRefused("a data URL must read data:<type>;base64,<data>", 400)
    encoded = url[match.end() :]
    most = think_setting("MAX_FILE_BYTES")
    if len(encoded) > (most + 2) // 3 * 4:
        raise FileRefused(f"the file is larger than {most} bytes", 413)
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise FileRefused("the data URL's base64 is not valid", 400) from None
    return match.group(1).lower(), data


def file_url(file_id: uuid.UUID | str) -> str:
    """Where a file is served (think_chat:file); FileRefused when the site has not mounted chat.urls."""
    try:
        return reverse("think_chat:file", args=[str(file_id)])
    except NoReverseMatch:
        raise FileRefused("files need chat.urls mounted (the URL think_chat:file)", 400) from None


def file_id_of(url: str) -> uuid.UUID | None:
    """The id of the file a URL of ours names (think_chat:file), None for any other URL."""
    match = _FILE_ID.search(url.split("?", 1)[0]) if url.startswith("/") else None
    return uuid.UUID(match.group(1)) if match else None


def _filename(part: Part) -> str:
    name = part.get("filename")
    if name is None:
        return ""
    if not isinstance(name, str) or len(name) > MAX_FILENAME or _CONTROL.search(name):
        raise FileRefused(
            f"a file's 'filename' must be a string of at most {MAX_FILENAME} characters, no control"
            " characters",
            400,
        )
    return name


@dataclass
class NewFile:
    """A file a request brings: stored (with the row its id names) only once the request is accepted."""

    id: uuid.UUID
    media_type: str
    data: bytes
    filename: str
    sha256: str


@dataclass
class Attachments:
    """A request's messages with their file parts pointing at stored files, and the files to store."""

    messages: list[UIMessage]
    new: list[NewFile] = field(default_factory=list)


def attachments_resolve(conversation_id: int, messages: list[UIMessage], *, check: set[str]) -> Attachments:
    """The file parts of the messages whose ids are in `check` (the request's new messages, and an edit),
    each checked and pointed at its file: a data URL becomes the URL of the conversation's file with
    that content (a NewFile when there is none yet); an upload's URL must name one of the conversation's
    files. Other messages are left as they are (echoes of stored ones). FileRefused says why not."""
    most = think_setting("MAX_MESSAGE_FILES")
    known: dict[str, ChatFile] = {}
    new: dict[str, NewFile] = {}
    resolved = []
    for message in messages:
        files = [p for p in message.get("parts") or () if isinstance(p, dict) and p.get("type") == "file"]
        if message["id"] not in check or not files:
            resolved.append(message)
            continue
        if len(files) > most:
            raise FileRefused(
                f"message {message['id']!r} carries {len(files)} files; at most {most} are accepted", 400
            )
        parts = []
        for part in message["parts"]:
            if isinstance(part, dict) and part.get("type") == "file":
                part = _resolve_part(conversation_id, part, known, new)
            parts.append(part)
        resolved.append({**message, "parts": parts})
    return Attachments(resolved, list(new.values()))


def _resolve_part(
    conversation_id: int, part: Part, known: dict[str, ChatFile], new: dict[str, NewFile]
) -> Part:
    url = part.get("url")
    if not isinstance(url, str):
        raise FileRefused("a file part needs a 'url': a data URL or the URL an upload returned", 400)
    filename = _filename(part)
    if url.startswith("data:"):
        media_type, data = parse_data_url(url)
        declared = part.get("mediaType")
        if isinstance(declared, str) and declared.lower() != media_type:
            raise FileRefused(f"the part says {declared!r} but its data URL says {media_type!r}", 400)
        check_file(media_type, data)
        digest = hashlib.sha256(data).hexdigest()
        stored = (
            known.get(digest)
            or ChatFile.objects.filter(conversation_id=conversation_id, sha256=digest).first()
        )
        if stored is not None:
            known[digest] = stored
            return _part(str(stored.id), stored.media_type, filename)
        pending = new.get(digest)
        if pending is None:
            pending = new[digest] = NewFile(uuid.uuid4(), media_type, data, filename, digest)
        return _part(str(pending.id), media_type, filename)
    file_id = file_id_of(url)
    stored = (
        ChatFile.objects.filter(pk=file_id, conversation_id=conversation_id).first()
        if file_id is not None
        else None
    )
    if stored is None:
        raise FileRefused(
            "a file part's 'url' must be a data URL or the URL of a file uploaded to this conversation", 400
        )
    return _part(str(stored.id), stored.media_type, filename)


def _part(file_id: str, media_type: str, filename: str) -> Part:
    part: Part = {"type": "file", "mediaType": media_type, "url": file_url(file_id)}
    if filename:
        part["filename"] = filename
    return part


_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"


def principal_file_refusal(principal: str, adding: int, *, address: str | None = None) -> None:
    """FileRefused (429) when `adding` more bytes would take `principal` past THINK["PRINCIPAL_FILE_
    BYTES_PER_DAY"], or, an anonymous visitor (a new principal with every cookie), their client
    `address` past THINK["ANONYMOUS_FILE_BYTES_PER_DAY_PER_ADDRESS"]. Call in the storing transaction:
    the lock it takes is held until that ends."""
    if not principal or not adding:
        return
    _address_file_refusal(principal, adding, address)
    most = think_setting("PRINCIPAL_FILE_BYTES_PER_DAY")
    if most is None:
        return
    with connection.cursor() as cursor:
        cursor.execute(_LOCK, [f"think-files:{principal}"])
    midnight = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    used = ChatFile.objects.filter(owner=principal, created_at__gte=midnight).aggregate(n=Sum("size"))["n"]
    if (used or 0) + adding > most:
        raise FileRefused(
            f"you have stored {used or 0} bytes of files today (UTC); at most {most} are accepted a day", 429
        )


def _address_file_refusal(principal: str, adding: int, address: str | None) -> None:
    most = think_setting("ANONYMOUS_FILE_BYTES_PER_DAY_PER_ADDRESS")
    if most is None or not address or not principal.startswith(ANONYMOUS_PREFIX):
        return
    key, cache = f"think:anonymous-file-bytes:{address}", shared_cache()
    cache.add(key, 0, timeout=86_400)  # a day from the address's first file
    if cache.incr(key, adding) > most:
        cache.decr(key, adding)  # refused: these bytes are not kept
        raise FileRefused(
            f"more than {most} bytes of files a day from your address without signing in; sign in", 429
        )


def files_store(conversation_id: int, owner: str, files: list[NewFile]) -> list[ChatFile]:
    """Keep new files: their bytes in default_storage, then their rows (call inside the accepting
    transaction, after `principal_file_refusal`)."""
    rows = []
    for new in files:
        name = default_storage.save(f"think/{new.id}", ContentFile(new.data))
        rows.append(
            ChatFile(
                id=new.id,
                conversation_id=conversation_id,
                owner=owner,
                storage_name=name,
                media_type=new.media_type,
                filename=new.filename,
                size=len(new.data),
                sha256=new.sha256,
            )
        )
    return ChatFile.objects.bulk_create(rows)


def file_upload(
    conversation_id: int,
    owner: str,
    media_type: str,
    data: bytes,
    filename: str,
    *,
    address: str | None = None,
) -> ChatFile:
    """An uploaded file, checked and kept (or the conversation's file with the same content); call in a
    transaction (the owner's daily bytes are counted under a lock held until it ends)."""
    check_file(media_type, data)
    _filename({"filename": filename or None})
    digest = hashlib.sha256(data).hexdigest()
    conversation_lock(conversation_id)  # as a chat request does: one content, one file
    existing = ChatFile.objects.filter(conversation_id=conversation_id, sha256=digest).first()
    if existing is not None:
        return existing
    principal_file_refusal(owner, len(data), address=address)
    [row] = files_store(conversation_id, owner, [NewFile(uuid.uuid4(), media_type, data, filename, digest)])
    return row


def file_part(row: ChatFile) -> Part:
    """The AI SDK file part (FileUIPart) of a stored file."""
    return _part(str(row.id), row.media_type, row.filename)


def file_deleted(sender: type[ChatFile], instance: ChatFile, **kwargs: Any) -> None:
    """post_delete of a ChatFile (chat.apps): its bytes leave the storage after the commit."""
    transaction.on_commit(lambda: default_storage.delete(instance.storage_name))


@dataclass(frozen=True)
class Attachment:
    """A stored file as the model gets it."""

    media_type: str
    data: bytes
    filename: str


def attachments_for_model(conversation_id: int, messages: list[UIMessage]) -> dict[str, Attachment]:
    """The bytes of the files the messages' file parts name, by file id (`file_id_of` their URL); files of
    this conversation only. A file that is gone is left out (the model is told so)."""
    ids = {
        file_id
        for message in messages
        for part in message.get("parts") or ()
        if isinstance(part, dict) and part.get("type") == "file"
        if (file_id := file_id_of(str(part.get("url", "")))) is not None
    }
    found: dict[str, Attachment] = {}
    if not ids:
        return found
    for row in ChatFile.objects.filter(conversation_id=conversation_id, pk__in=ids):
        try:
            with default_storage.open(row.storage_name, "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        found[str(row.id)] = Attachment(row.media_type, data, row.filename)
    return found
