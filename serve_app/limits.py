"""The limits an account carries: an API key, a team, or the users of identity tokens
(their limits are configuration: serve_app/settings.py ``auth.jwt.limits``). Shared by
identity (the records), admission (the scripts read them) and settings."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from contract.model_config import CacheIsolation, PriorityTier


class KeyLimits(BaseModel):
    """Quotas of one key; 0 means unlimited."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] | None = Field(None, description="Models this key may use; null = all.")
    requests_per_minute: int = Field(0, ge=0, description="Requests admitted per minute (GCRA: a burst of this many).")
    tokens_per_minute: int = Field(0, ge=0, description="Tokens reserved per minute (prompt estimate plus max_tokens).")
    max_concurrent: int = Field(0, ge=0, description="Requests running at once.")
    daily_token_budget: int = Field(0, ge=0, description="Tokens per UTC day.")
    monthly_token_budget: int = Field(0, ge=0, description="Tokens per UTC month.")
    daily_cost_budget_usd: float = Field(
        0, ge=0, le=1e6, description="Spend per UTC day in USD at the models' prices (reserved at admission)."
    )
    monthly_cost_budget_usd: float = Field(0, ge=0, le=1e6, description="Spend per UTC month in USD.")
    priority: PriorityTier = Field(
        "normal",
        description="Scheduling tier: high, normal or low. Under load a model's engine runs higher tiers "
        "first (where the model enables priority scheduling) and the ingress refuses lower tiers first "
        "when the model's queue fills (contract/model_config.py PrioritySettings).",
    )
    cache_isolation: CacheIsolation | None = Field(
        None,
        description="Whose requests share the prefix cache with this key's (a team's: its keys'): key, "
        "team or shared; unset: its team's, else the model's (contract/model_config.py cache_isolation).",
    )
