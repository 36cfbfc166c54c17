"""The one user-facing error type, shared by every layer.

A `PlannerError` says what is wrong, where, and how to fix it. The CLI and the runtime render it
once as a message and a non-zero exit (status 2); anything else escaping is a bug and keeps its
traceback.
"""

from __future__ import annotations


class PlannerError(Exception):
    """A problem with the user's input or environment, rendered without a traceback.

    Args:
        message: what is wrong and where (one or two sentences).
        hint: how to fix it, when there is something specific to say.
    """

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


def format_validation_error(err: Exception, *, source: str) -> str:
    """Render a pydantic ValidationError as short `where: what` lines naming `source`."""
    errors = getattr(err, "errors", None)
    if errors is None:
        return f"{source}: {err}"
    lines = []
    for e in errors():
        where = ".".join(str(p) for p in e.get("loc", ())) or "(top level)"
        msg = e.get("msg", "invalid")
        if e.get("type") == "extra_forbidden":
            msg = "unknown key (not part of the schema; check its spelling)"
        lines.append(f"  {where}: {msg}")
    return f"{source} is invalid:\n" + "\n".join(lines)


def brief(value: object, *, limit: int = 120) -> str:
    """`repr(value)`, cut to `limit` characters, for quoting user input in a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
