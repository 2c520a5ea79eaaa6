"""Faults: unexpected errors of a provider, a tool or a turn, stored for operators (`recovery.models.Fault`).

The owning app decides what is unexpected and what clients see; this module only stores the details.
Rows go with the incidents' retention (`recovery.operations.retention.faults_sweep`).
"""

from __future__ import annotations

import traceback
import uuid
from typing import Any

from recovery.models import Fault

# A provider's error body, or a tool's, can be large; the row keeps its head.
MAX_TEXT_CHARS = 20_000


def fault_record(
    *,
    fault_id: uuid.UUID,
    kind: str,
    error: BaseException,
    conversation_id: Any = None,
    fiber_id: Any = None,
    request_id: str = "",
) -> Fault:
    """Store one fault with its class, text and traceback."""
    cls = type(error)
    trace = "".join(traceback.format_exception(cls, error, error.__traceback__))
    return Fault.objects.create(
        id=fault_id,
        kind=kind,
        conversation_id=conversation_id,
        fiber_id=fiber_id,
        request_id=request_id or "",
        error_class=f"{cls.__module__}.{cls.__qualname__}"[:255],
        text=str(error)[:MAX_TEXT_CHARS],
        traceback=trace[-MAX_TEXT_CHARS:],
    )
