"""How the demo site talks to its scripted model (`python -m think_scripted.server`): the
litellm kwargs of THINK["MODEL"] and the entries litellm's cost map lacks for it. No I/O at import."""

from __future__ import annotations

import os
from typing import Any

MODEL = "openai/scripted"
# The context window the scripted model declares when run as the demo's model (tokens, as it counts them:
# about four characters each): litellm's model info says so too, so an agent can compact before it.
CONTEXT_WINDOW = 128_000
DEFAULT_URL = "http://127.0.0.1:8765/v1"
# The provider dialects the scripted model speaks: litellm's model name for each, and the path under the
# server's root that litellm is given as `api_base` (it adds the rest: /chat/completions, /v1/messages,
# /models/{model}:streamGenerateContent).
DIALECTS = {
    "openai": ("openai/scripted", "/v1"),
    "anthropic": ("anthropic/scripted", ""),
    "gemini": ("gemini/scripted", "/v1beta"),
}
# For THINK["LITELLM_MODELS"]. Its mode stays "chat": "responses" would send every chat completion
# through litellm's Responses bridge.
LITELLM_MODELS = {
    model: {
        "litellm_provider": model.split("/", 1)[0],
        "mode": "chat",
        "supports_native_streaming": True,
        # Without it litellm folds a Gemini model's system prompt into the first user message.
        "supports_system_messages": True,
        "max_input_tokens": CONTEXT_WINDOW,
    }
    for model, _ in DIALECTS.values()
}


def litellm_kwargs(url: str | None = None, dialect: str | None = None) -> dict[str, Any]:
    """THINK["MODEL"] for the scripted model at `url` (its OpenAI base, default: SCRIPTED_MODEL_URL, or
    port 8765) in `dialect` (default: SCRIPTED_MODEL_DIALECT, or "openai"; see DIALECTS)."""
    base = url or os.environ.get("SCRIPTED_MODEL_URL") or DEFAULT_URL
    name = dialect or os.environ.get("SCRIPTED_MODEL_DIALECT") or "openai"
    if name not in DIALECTS:
        raise ValueError(f"SCRIPTED_MODEL_DIALECT must be one of {', '.join(DIALECTS)}, got {name!r}")
    model, path = DIALECTS[name]
    return {
        "model": model,
        "api_base": base.removesuffix("/").removesuffix("/v1") + path,
        "api_key": "sk-scripted",
    }
