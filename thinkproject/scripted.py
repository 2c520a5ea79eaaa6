"""How the demo site talks to its scripted model (`python -m thinkproject.scripted_model`): the
litellm kwargs of THINK["MODEL"] and the entry litellm's cost map lacks for it. No I/O at import."""

from __future__ import annotations

import os
from typing import Any

MODEL = "openai/scripted"
DEFAULT_URL = "http://127.0.0.1:8765/v1"
# For THINK["LITELLM_MODELS"]. Its mode stays "chat": "responses" would send every chat completion
# through litellm's Responses bridge.
LITELLM_MODELS = {MODEL: {"litellm_provider": "openai", "mode": "chat", "supports_native_streaming": True}}


def litellm_kwargs(url: str | None = None) -> dict[str, Any]:
    """THINK["MODEL"] for the scripted model at `url` (default: SCRIPTED_MODEL_URL, or port 8765)."""
    api_base = url or os.environ.get("SCRIPTED_MODEL_URL") or DEFAULT_URL
    return {"model": MODEL, "api_base": api_base, "api_key": "sk-scripted"}
