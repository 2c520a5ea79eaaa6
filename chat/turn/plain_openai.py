"""A model call that needs no litellm: an OpenAI-compatible server litellm itself passes requests through to.

Importing litellm costs a worker about 3 s of CPU and 190 MB. A worker that recovers a turn after a
crash or a deploy would wait that long before its first word, and hold that much while idle. For one
kind of model litellm adds nothing to the request: `openai/<name>` with an explicit `api_base`, where
`<name>` is a model litellm does not know (a self-hosted vLLM, llama.cpp, LM Studio, Ollama or litellm
proxy model, the scripted model). litellm routes it to its "unknown OpenAI model" config, which sends
the messages and the parameters as they are. This module builds that same request itself, while
litellm is not loaded:

- only the parameters in PARAMS (each sent as is by litellm; tests/chat/turn/test_plain_openai.py compares
  every one against litellm's own request) and messages whose content is text;
- never a model litellm's bundled cost map names, nor one that looks like an OpenAI model (o1, gpt-...):
  litellm rewrites those (max_completion_tokens, system prompts as user messages, ...);
- never when the site asked litellm for its remote cost map (LITELLM_LOCAL_MODEL_COST_MAP other than
  True), which could name models the bundled one does not.

Anything else, and everything once litellm is loaded (by a turn that needs it, an error to map, or the
site itself), goes through litellm as before. Errors are mapped by litellm, loaded then.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from ..conf import think_setting
from .openai_compat import _LITELLM_ONLY, LeanRequest

PREFIX = "openai/"
# OpenAI chat parameters litellm's unknown-model config sends unchanged (None values are left out, as
# litellm leaves out what is not set; tool_choice only goes with tools).
PARAMS = frozenset(
    {
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "reasoning_effort",
        "parallel_tool_calls",
        "tool_choice",
        "tools",
        "response_format",
    }
)
# litellm's own keyword arguments (they shape the call, not the body): the lean read's list.
CALL_KEYS = _LITELLM_ONLY
# Names litellm's OpenAI configs treat specially (o-series, GPT-5, audio, search, fine-tunes...), whether
# or not the bundled map lists them: a proxy alias with such a name goes through litellm.
OPENAI_LIKE = re.compile(
    r"^(o\d|gpt-|chatgpt|ft:|text-|davinci|babbage|codex|computer-use|omni|whisper|tts|dall-e)"
)
ROLES = frozenset({"system", "user", "assistant", "tool"})
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})
COST_KEYS = ("input_cost_per_token", "output_cost_per_token")


def litellm_loaded() -> bool:
    return "litellm" in sys.modules


def local_cost_map() -> bool:
    """Whether litellm, when loaded, reads its bundled cost map (chat.turn.llm.load_litellm sets this)."""
    return os.environ.get("LITELLM_LOCAL_MODEL_COST_MAP", "True") == "True"


@functools.cache
def catalog() -> frozenset[str]:
    """Every model name of litellm's bundled cost map, read as JSON without importing litellm."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    path = Path(next(iter(spec.submodule_search_locations))) / "model_prices_and_context_window_backup.json"
    with path.open(encoding="utf-8") as file:
        return frozenset(json.load(file))


def _names(model: str) -> tuple[str, str]:
    return model, model.split("/", 1)[-1]


def model_qualifies(model: object) -> bool:
    """Whether litellm would pass a request for this model string through unchanged (see the module)."""
    if not isinstance(model, str) or not model.startswith(PREFIX) or not local_cost_map():
        return False
    name = model[len(PREFIX) :]
    if not name or OPENAI_LIKE.match(name.lower()) or name in (think_setting("LITELLM_MODELS") or {}):
        return False  # (a registered `openai/x` joins litellm's OpenAI catalog as the name "openai/x")
    known = catalog()
    return not any(n in known for n in _names(model))


def kwargs_qualify(kwargs: dict[str, Any]) -> bool:
    """Whether a call with these litellm kwargs (the agent's model dict and the call's extras) qualifies."""
    base = kwargs.get("api_base") or kwargs.get("base_url")
    if not isinstance(base, str) or not base.startswith(("http://", "https://")):
        return False
    headers = kwargs.get("extra_headers")
    if headers is not None and not isinstance(headers, dict):
        return False
    return model_qualifies(kwargs.get("model")) and set(kwargs) <= CALL_KEYS | PARAMS


def _messages_qualify(messages: list[Any]) -> bool:
    return all(
        isinstance(m, dict)
        and m.get("role") in ROLES
        and set(m) <= MESSAGE_KEYS
        and (m.get("content") is None or isinstance(m.get("content"), str))
        for m in messages
    )


def request(model: dict[str, Any], messages: list[Any], **extra: Any) -> LeanRequest | None:
    """The streamed request litellm would send, built without litellm; None
    when litellm is loaded or this call does not qualify."""
    kwargs = {**model, **extra}
    if litellm_loaded() or not kwargs_qualify(kwargs) or not _messages_qualify(messages):
        return None
    params = {k: v for k, v in kwargs.items() if k in PARAMS and v is not None}
    if not params.get("tools"):
        params.pop("tools", None)
        params.pop("tool_choice", None)
    name = str(kwargs["model"])[len(PREFIX) :]
    body = {
        "model": name,
        "messages": messages,
        **params,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    base = str(kwargs.get("api_base") or kwargs.get("base_url")).rstrip("/")
    url = base if "chat/completions" in base else f"{base}/chat/completions"
    headers = {str(k): str(v) for k, v in (kwargs.get("extra_headers") or {}).items()}
    api_key = kwargs.get("api_key") or os.environ.get("OPENAI_API_KEY")
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    if "content-type" not in headers and "Content-Type" not in headers:
        headers["Content-Type"] = "application/json"
    timeout = kwargs.get("timeout")
    return LeanRequest(
        url=url,
        headers=headers,
        body=json.dumps(body).encode(),
        model=name,
        provider="openai",
        timeout=float(timeout) if isinstance(timeout, int | float) else None,
    )


def unpriced_without_litellm(model: str) -> bool:
    """Whether litellm would leave this model's steps unpriced, known without loading it: a model its
    bundled map does not name, and that the site registered (THINK["LITELLM_MODELS"]) without prices or
    not at all. False means ask litellm."""
    if not local_cost_map():
        return False
    names = _names(model)
    if any(n in catalog() for n in names):
        return False
    registered = think_setting("LITELLM_MODELS") or {}
    entries = [registered[n] for n in names if n in registered]
    return not any(not isinstance(e, dict) or any(e.get(k) for k in COST_KEYS) for e in entries)
