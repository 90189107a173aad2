"""What an operator declares for tenants and keys: limits, budgets, and a unit's price table."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TENANT_NAME = r"^[a-z0-9][a-z0-9._-]{0,63}$"
_TENANT = re.compile(TENANT_NAME)


def valid_tenant_name(name: str) -> bool:
    return _TENANT.fullmatch(name) is not None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LimitsSpec(_Strict):
    """Per key or per tenant; a missing limit is no limit."""

    requests_per_min: int | None = Field(None, ge=1, description="requests admitted per minute (token bucket)")
    tokens_per_min: int | None = Field(None, ge=1, description="prompt + completion tokens per minute; a request "
                                       "reserves prompt + max_tokens and gets the unused part back when it ends")
    max_concurrent: int | None = Field(None, ge=1, description="requests admitted and not yet finished")
    max_queued: int | None = Field(None, ge=1, description="admitted requests still waiting for their first token")


class BudgetSpec(_Strict):
    """A cap on spend over a period (UTC calendar day or month, or for ever), in tokens and/or cost."""

    period: Literal["day", "month", "total"] = "month"
    tokens: int | None = Field(None, ge=0, description="prompt + completion tokens")
    cost: float | None = Field(None, ge=0, description="cost units, from the units' price tables")

    @model_validator(mode="after")
    def _something(self) -> "BudgetSpec":
        if self.tokens is None and self.cost is None:
            raise ValueError("a budget needs tokens or cost (or both)")
        return self


class PricingSpec(_Strict):
    """A unit's price table: cost units per million tokens, per PFLOP and per GB-hour of instance memory."""

    input_per_mtok: float = Field(0.0, ge=0, description="per million prompt tokens computed")
    cached_input_per_mtok: float | None = Field(None, ge=0, description="per million prompt tokens served from "
                                                "the prefix cache (default: the input price)")
    output_per_mtok: float = Field(0.0, ge=0, description="per million completion tokens")
    per_pflop: float = Field(0.0, ge=0, description="per 10^15 floating-point operations")
    per_gb_hour: float = Field(0.0, ge=0, description="per GB-hour of instance memory (weights + KV) apportioned")

    def cost(self, prompt: int, cached: int, completion: int, flops: float = 0.0, gb_hours: float = 0.0) -> float:
        cached_price = self.input_per_mtok if self.cached_input_per_mtok is None else self.cached_input_per_mtok
        return ((prompt - cached) * self.input_per_mtok + cached * cached_price
                + completion * self.output_per_mtok) / 1e6 + flops / 1e15 * self.per_pflop \
            + gb_hours * self.per_gb_hour


NO_PRICING = PricingSpec()


class TenantSpec(_Strict):
    name: str = Field(..., pattern=TENANT_NAME)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    budgets: list[BudgetSpec] = Field(default_factory=list, max_length=8)
    weight: float = Field(1.0, gt=0, le=1000, description="its share of the scheduler when tenants compete")


class TenantUpdate(_Strict):
    limits: LimitsSpec | None = None
    budgets: list[BudgetSpec] | None = Field(None, max_length=8)
    weight: float | None = Field(None, gt=0, le=1000)


class KeySpec(_Strict):
    name: str = Field("", max_length=128, description="a label for people")
    role: Literal["user", "admin"] = "user"
    units: list[str] | None = Field(None, max_length=256, description="units/models it may call; null: all")
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    budgets: list[BudgetSpec] = Field(default_factory=list, max_length=8)
