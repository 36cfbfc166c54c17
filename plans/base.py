"""The base class of every schema: unknown keys are errors, instances are immutable, and no float
is infinite or NaN (JSON cannot carry them, and no quantity a plan states is either)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A frozen pydantic model that forbids unknown keys (a typo is an error, not a default) and
    rejects infinite and NaN floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)
