"""What a request cost, in nano-dollars (integers, so Redis adds them exactly): its
model's prices (``ModelConfig.pricing``, USD per million tokens) times the tokens it
was charged, less the model's batch discount for a batch request. Recorded at
settlement per key, model and day (lua/settle.lua), served as OpenAI's Costs API
(usage_report.py)."""

from __future__ import annotations

from dataclasses import dataclass

from contract.model_config import Pricing

NANOS_PER_USD = 10**9


@dataclass(frozen=True)
class Rates:
    """Nano-dollars per token."""

    prompt: float
    completion: float
    cached_prompt: float

    @classmethod
    def of(cls, pricing: Pricing, batch: bool = False) -> Rates:
        factor = 1 - pricing.batch_discount if batch else 1.0
        cached = (
            pricing.prompt_per_million
            if pricing.cached_prompt_per_million is None
            else pricing.cached_prompt_per_million
        )
        # USD per million tokens = nano-dollars per token × 1,000.
        return cls(
            pricing.prompt_per_million * 1000 * factor,
            pricing.completion_per_million * 1000 * factor,
            cached * 1000 * factor,
        )


@dataclass(frozen=True)
class Cost:
    """A settled request's cost: its real usage priced (input, output), or, when its
    usage was never reported, its reservation priced (reserved). ``cached_prompt_tokens``:
    the prompt tokens priced at the cached rate (the usage API counts them apart)."""

    input_nanos: int = 0
    output_nanos: int = 0
    reserved_nanos: int = 0
    cached_prompt_tokens: int = 0

    @property
    def nanos(self) -> int:
        """All it cost (what settlement adds to the day's and month's spend)."""
        return self.input_nanos + self.output_nanos + self.reserved_nanos

    @classmethod
    def of(
        cls,
        rates: Rates | None,
        prompt: int,
        completion: int,
        reserved_prompt: int,
        reserved_completion: int,
        cached_prompt: int = 0,
    ) -> Cost:
        """``prompt`` -1: usage unknown, the reservation is what was charged (at the
        full prompt price: what admission reserved). ``cached_prompt``: how many of
        ``prompt`` the engine had cached (never more than ``prompt``)."""
        cached = max(0, min(cached_prompt, prompt))
        if rates is None:
            return cls(cached_prompt_tokens=cached)
        if prompt < 0:
            return cls(reserved_nanos=round(reserved_prompt * rates.prompt + reserved_completion * rates.completion))
        return cls(
            round((prompt - cached) * rates.prompt + cached * rates.cached_prompt),
            round(completion * rates.completion),
            cached_prompt_tokens=cached,
        )


def reservation_nanos(rates: Rates | None, reserved_prompt: int, reserved_completion: int) -> int:
    """What a request's reservation costs: the money budgets hold this at admission
    (lua/admit.lua) until settlement puts the real cost in its place. The same
    amount ``Cost.of`` charges when the usage is never known."""
    return Cost.of(rates, -1, 0, reserved_prompt, reserved_completion).reserved_nanos
