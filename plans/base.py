"""The base class of every schema: unknown keys are errors, instances are immutable, and no float
is infinite or NaN (JSON cannot carry them, and no quantity a plan states is either)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from plans.errors import PlannerError, format_validation_error

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """A frozen pydantic model that forbids unknown keys (a typo is an error, not a default) and
    rejects infinite and NaN floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


def validated(cls: type[M], data: Any, *, source: str) -> M:
    """`cls.model_validate(data)`, with any problem as one `PlannerError` naming `source` and
    listing each field at fault."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise PlannerError(format_validation_error(e, source=source)) from None
