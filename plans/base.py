"""The base class of every schema: unknown keys are errors and instances are immutable."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A frozen pydantic model that forbids unknown keys (a typo is an error, not a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
