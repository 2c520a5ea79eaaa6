"""Small real files for the tests of attachments (chat.transcript.files): a PNG a browser draws, a PDF,
text; and their data URLs."""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib


def png(width: int = 2, height: int = 2, rgb: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A valid RGB PNG of one colour."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


PDF = b"%PDF-1.4\n1 0 obj <<>> endobj\ntrailer <<>>\n%%EOF\n"


def data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def file_part(media_type: str, data: bytes, filename: str | None = None) -> dict[str, object]:
    part: dict[str, object] = {"type": "file", "mediaType": media_type, "url": data_url(media_type, data)}
    if filename is not None:
        part["filename"] = filename
    return part


def described(media_type: str, data: bytes, filename: str | None = None) -> str:
    """How the scripted model's `[files]` reply names a file it received."""
    name = f" named {filename}" if filename else ""
    return f"{media_type} {len(data)} bytes sha256 {hashlib.sha256(data).hexdigest()[:16]}{name}"
