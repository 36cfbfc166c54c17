"""Dataset files (JSONL, Parquet) as rows: one reader for the planner (which records a file's row
count in the plan) and the runtime (which draws and tokenizes the rows, `runtime.data`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plans.base import loads_json
from plans.errors import PlannerError


def read_rows(path: str | Path, *, fmt: str) -> list[dict[str, Any]]:
    """Every row of a JSONL or Parquet file, as dicts."""
    path = Path(path)
    if not path.is_file():
        raise PlannerError(f"dataset {str(path)!r} does not exist or is not a file")
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq

            return list(pq.read_table(path).to_pylist())
        except OSError as e:
            raise PlannerError(f"cannot read dataset {str(path)!r}: {e}") from None
        except Exception as e:  # pyarrow's own error types for a malformed file
            raise PlannerError(f"dataset {str(path)!r} is not a readable Parquet file: {e}") from None
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PlannerError(f"cannot read dataset {str(path)!r}: {e}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        row = loads_json(line, source=f"dataset {str(path)!r} line {n}")
        if not isinstance(row, dict):
            raise PlannerError(f"dataset {str(path)!r} line {n} is not a JSON object")
        rows.append(row)
    if not rows:
        raise PlannerError(f"dataset {str(path)!r} has no rows")
    return rows


def data_format(path: str) -> str:
    """'jsonl' or 'parquet' from a file name; a `PlannerError` for anything else."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise PlannerError(f"dataset {path!r}: unknown format {suffix or '(no suffix)'!r}",
                       hint="give a .jsonl file (one JSON object per line) or a .parquet file")


def count_rows(path: str) -> int:
    """Rows of a dataset file."""
    return len(read_rows(path, fmt=data_format(path)))
