"""Continuing by prefill: the partial answer stays the last message, and the model extends it.

Where a provider can extend a final assistant message, a continuation sends the partial as it is and no
instruction: the model goes on from its own last token instead of being asked to, which is where real
models restart and repeat. Anthropic's Messages API does it natively (litellm sends a final assistant
message as Anthropic's prefill); Mistral's API takes the final assistant message with `"prefix": true`;
vLLM's OpenAI-compatible server takes `continue_final_message` with `add_generation_prompt: false`.
Everything else (OpenAI's API among them) gets the instruction (chat.turn.loop.CONTINUE_PROMPT).
`Think.continuation_style` overrides the choice per agent.
"""

from __future__ import annotations

from typing import Any

STYLES = ("auto", "prefill", "instruction")
# litellm provider prefixes whose APIs extend a final assistant message
PREFILL_PROVIDERS = ("anthropic/", "mistral/", "hosted_vllm/")


def prefill_style(model: dict[str, Any]) -> str:
    """ "prefill" when the model's provider extends a final assistant message, else "instruction"."""
    name = str(model.get("model", ""))
    if name.startswith(PREFILL_PROVIDERS) or name.startswith("claude"):
        return "prefill"
    return "instruction"


def prefill_request(model: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """What the provider needs besides the final assistant message to extend it: the message flagged as
    a prefix (Mistral), or the server told to continue it (vLLM). Changes `messages` in place; returns
    the extra request arguments."""
    name = str(model.get("model", ""))
    if name.startswith("mistral/") and messages and messages[-1].get("role") == "assistant":
        messages[-1] = {**messages[-1], "prefix": True}
    if name.startswith("hosted_vllm/"):
        return {"extra_body": {"continue_final_message": True, "add_generation_prompt": False}}
    return {}
