"""Files over HTTP: an upload for a conversation, and a file served back to whoever may open it.

- `POST <mount>/files/<agent>/<name>` (multipart, one field `file`): the file is checked and kept
  (chat.transcript.files: its type against its bytes, its size, its owner's bytes of the day) and the
  answer is `201` with the AI SDK's file part `{"type": "file", "mediaType", "filename", "url"}`, for a
  message's `parts` (useChat: `sendMessage({text, files: [part]})`). Refusals are plain text: 413 too
  big, 415 a type not accepted or bytes that are not what they claim, 429 the day's bytes used, 400
  anything else. For files too big to go inside a chat request (MAX_FRAME_BYTES).
- `GET <mount>/files/<id>`: the file, to a principal the access policy lets open its conversation; 404
  to anyone else (whether it exists is not told). It is sent as the type it was checked to be, never
  sniffed, and sandboxed: a browser runs nothing in it.

Access is the HTTP wire's (chat.wire.http): a bearer token, or the session cookie and Django's CSRF
check for the POST. The request body is bounded before Django reads it (chat.wire.bodies).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.core.files.storage import default_storage
from django.db import transaction
from django.http import FileResponse, HttpRequest, HttpResponseBase, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from ..access import Credentials, access_policy, conversation_open_as
from ..conf import think_setting
from ..exceptions import AccessDenied, ConversationLimit, FileRefused
from ..models import ChatFile
from ..transcript.files import file_part, file_upload
from .http import _Door, _refused
from .pool import web_db

# The multipart envelope around an upload's bytes (boundaries, headers of the part), on top of the file.
MULTIPART_OVERHEAD = 64 * 1024


def upload_limit() -> int:
    """The largest upload body: a file of THINK["MAX_FILE_BYTES"] and its multipart envelope."""
    return int(think_setting("MAX_FILE_BYTES")) + MULTIPART_OVERHEAD


@csrf_exempt  # checked by _Door for cookie requests (a token's are not a browser's)
@require_POST
async def upload(request: HttpRequest, agent: str, name: str) -> HttpResponseBase:
    length = request.META.get("CONTENT_LENGTH") or ""
    if length.isdigit() and int(length) > upload_limit():
        most = think_setting("MAX_FILE_BYTES")
        return _refused(413, f"File refused: the upload is larger than the {most} bytes a file may have")
    door = _Door(request, agent)
    refusal = await web_db(door.check)(name, write=True)
    if refusal is not None:
        return refusal
    try:
        answer = await web_db(_keep)(request, door, agent, name)
    except FileRefused as exc:
        return _refused(exc.status, f"File refused: {exc}")
    except ConversationLimit as exc:
        return _refused(429, str(exc))
    except AccessDenied as exc:
        return _refused(403, str(exc))
    return JsonResponse(answer, status=201)


def _keep(request: HttpRequest, door: _Door, agent: str, name: str) -> dict[str, Any]:
    files = request.FILES.getlist("file")
    if len(files) != 1:
        raise FileRefused("send one file, in the multipart field 'file'", 400)
    [upload] = files
    most = think_setting("MAX_FILE_BYTES")
    if upload.size is None or upload.size > most:
        raise FileRefused(f"the file is larger than the {most} bytes a file may have", 413)
    media_type = (upload.content_type or "").split(";", 1)[0].strip().lower()
    data = upload.read()
    conversation = conversation_open_as(
        agent=agent, name=name, principal=door.principal, policy=access_policy(), address=door.address
    )
    with transaction.atomic():
        row = file_upload(
            conversation.pk, door.principal, media_type, data, upload.name or "", address=door.address
        )
    return file_part(row)


@require_GET
async def serve(request: HttpRequest, file_id: uuid.UUID) -> HttpResponseBase:
    credentials = Credentials.from_request(request)
    found = await web_db(_readable)(credentials, file_id)
    if found is None:
        return _refused(404, "no such file")
    row, handle = found
    response = FileResponse(
        handle,
        content_type=row.media_type,
        as_attachment=not row.media_type.startswith("image/"),
        filename=row.filename,
    )
    response["X-Content-Type-Options"] = "nosniff"
    response["Content-Security-Policy"] = "sandbox; default-src 'none'"
    response["Cache-Control"] = "private, max-age=3600"
    return response


def _readable(credentials: Credentials, file_id: uuid.UUID) -> tuple[ChatFile, Any] | None:
    """The file and its bytes opened, if the caller may open its conversation and the bytes are there;
    None otherwise."""
    policy = access_policy()
    try:
        principal = policy.principal(credentials)
    except AccessDenied:
        return None
    row = ChatFile.objects.select_related("conversation").filter(pk=file_id).first()
    if row is None or not policy.may_access(principal, row.conversation):
        return None
    try:
        return row, default_storage.open(row.storage_name, "rb")
    except OSError:  # deleted from the storage
        return None
