"""The base class of every schema: unknown keys are errors, instances are immutable, and no float
is infinite or NaN (JSON cannot carry them, and no quantity a plan states is either)."""

from __future__ import annotations

import json
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


def loads_json(text: str, *, source: str) -> Any:
    """`json.loads(text)`, with every way it fails as one `PlannerError` naming `source`: bad
    syntax, nesting too deep, or an integer too long to convert (Python refuses more than 4300
    digits; no quantity a planner file holds has more than 20)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlannerError(f"{source} is not valid JSON: {e}") from None
    except RecursionError:
        raise PlannerError(f"{source} is not usable: its JSON nests too deeply") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise PlannerError(f"{source} is not usable: it holds a number too long to read ({e})") from None
