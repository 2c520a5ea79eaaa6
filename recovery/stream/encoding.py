"""The one JSON encoding of what streams: a stored chunk's body (recovery.stream.buffer) and every frame the
chat wire sends (chat.protocol). Compact and with non-ASCII kept, so a body never holds a raw
newline (a segment joins bodies with one) and a frame is as small as it can be. No Django import: the
wire codec uses it too."""

from __future__ import annotations

import json
from typing import Any


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
