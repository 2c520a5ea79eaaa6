"""What a model step costs: the agent's own prices (`Think.model_prices`), else litellm's cost map.

Costs are Decimals in the currency of the prices (litellm's map is in US dollars); a model litellm
has no price for, and no prices of the agent's, leaves the cost unknown (None): never a guess, and
never a failed turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from . import plain_openai
from .llm import Usage

logger = logging.getLogger(__name__)


def _price(name: str, value: object) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, Decimal | int | str):
        raise ValueError(
            f"ModelPrices.{name} must be a Decimal (Decimal('0.000002'), not a float); got {value!r}"
        )
    try:
        price = Decimal(value)
    except ArithmeticError:
        raise ValueError(f"ModelPrices.{name} must be a Decimal; got {value!r}") from None
    if not price.is_finite() or price < 0:
        raise ValueError(f"ModelPrices.{name} must be a Decimal of 0 or more; got {value!r}")
    return price


@dataclass(frozen=True)
class ModelPrices:
    """Prices per token, in any one currency: input, output, and input read from the provider's prompt
    cache (the input price when None)."""

    input: Decimal
    output: Decimal
    cached_input: Decimal | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input", _price("input", self.input))
        object.__setattr__(self, "output", _price("output", self.output))
        if self.cached_input is not None:
            object.__setattr__(self, "cached_input", _price("cached_input", self.cached_input))

    def cost(self, usage: Usage) -> Decimal:
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        cached_rate = self.cached_input if self.cached_input is not None else self.input
        return (
            (usage.prompt_tokens - cached) * self.input
            + cached * cached_rate
            + usage.completion_tokens * self.output
        )


def needs_litellm(prices: ModelPrices | None, model: str | None) -> bool:
    """Whether step_cost must ask litellm's cost map (so it must be loaded first, off the loop)."""
    return (
        prices is None
        and bool(model)
        and not plain_openai.litellm_loaded()
        and not plain_openai.unpriced_without_litellm(str(model))
    )


def step_cost(prices: ModelPrices | None, model: str | None, usage: Usage) -> Decimal | None:
    """The cost of one step's usage: by `prices` when the agent gives them, else litellm's cost map for
    `model`; None when neither knows it."""
    if prices is not None:
        return prices.cost(usage)
    if not model or (not plain_openai.litellm_loaded() and plain_openai.unpriced_without_litellm(model)):
        return None
    import litellm  # loaded by now where it takes time (needs_litellm)

    try:
        info = litellm.get_model_info(model)
    except Exception:  # a model litellm does not know: unpriced
        return None
    if not (info.get("input_cost_per_token") or info.get("output_cost_per_token")):
        return None  # known (THINK["LITELLM_MODELS"]) but without prices: unpriced, not free
    try:
        prompt, completion = litellm.cost_per_token(
            model=model,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cache_read_input_tokens=usage.cached_tokens,
        )
    except Exception as exc:  # an unmapped model (litellm raises its own errors for that): unpriced
        logger.debug("no price for %s: %s", model, exc)
        return None
    return Decimal(str(prompt)) + Decimal(str(completion))


def as_text(cost: Any) -> str | None:
    return None if cost is None else str(cost)
