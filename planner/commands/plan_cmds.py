"""Commands on plans: compile, show, validate, schema."""

from __future__ import annotations

import json

import typer


def schema() -> None:
    """Print the JSON Schema of the plan format."""
    from plans.plan import Plan

    typer.echo(json.dumps(Plan.model_json_schema(), indent=2))


def register(app: typer.Typer) -> None:
    app.command()(schema)
