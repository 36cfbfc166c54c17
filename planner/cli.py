"""The `planner` command line: thin commands that parse, call a library function, and render.

Every user-facing problem is a `PlannerError`, rendered once here as a message and exit status 2;
set PLANNER_DEBUG=1 to see its traceback too. Commands live in `planner.commands.*`, each module
registering its own on the app.
"""

from __future__ import annotations

import inspect
import os
import sys

import typer
from rich.console import Console

from plans.errors import PlannerError, brief

app = typer.Typer(
    name="planner",
    help="Execution-plan compiler for LLM training and RLHF.\n\n"
    "Describe models, the calls one iteration makes on them, and a GPU cluster; get the fastest "
    "plan that fits: a mesh and hybrid-parallel layout per call, and the parameter reallocations "
    "between them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def reflow(text: str) -> str:
    """A help text with each prose paragraph on one line, so the terminal wraps it at its own width
    (rich keeps a docstring's line breaks); indented lines (examples) keep theirs."""
    out: list[str] = []
    for line in text.splitlines():
        joinable = out and out[-1] and line and not line[0].isspace() and not out[-1][0].isspace()
        if joinable and not out[-1].endswith(":"):
            out[-1] += " " + line
        else:
            out.append(line)
    return "\n".join(out)


def _register_commands() -> None:
    from planner.commands import COMMAND_MODULES

    if app.registered_commands:  # once per process: `main` may run many times (tests call it in-process)
        return
    for module in COMMAND_MODULES:
        module.register(app)
    for command in app.registered_commands:  # typer falls back to the docstring when help is unset
        text = command.help or (inspect.getdoc(command.callback) if command.callback else None)
        if text:
            command.help = reflow(text)


def render_error(err: PlannerError, console: Console | None = None) -> None:
    console = console or Console(stderr=True, highlight=False)
    console.print(f"[bold red]error:[/] {err.message}", markup=True, soft_wrap=True)
    if err.hint:
        console.print(f"[dim]hint:[/] {err.hint}", soft_wrap=True)


@app.callback()
def _root() -> None:
    """Execution-plan compiler for LLM training and RLHF."""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    _register_commands()
    try:
        app(args=argv, prog_name="planner")
    except PlannerError as err:
        if os.environ.get("PLANNER_DEBUG"):
            raise
        render_error(err)
        sys.exit(err.exit_code)
    except OSError as err:  # the file system refused a path no check above anticipated: still the user's input
        if os.environ.get("PLANNER_DEBUG"):
            raise
        where = f" {brief(str(err.filename))}" if err.filename is not None else ""
        render_error(PlannerError(f"cannot access{where}: {err.strerror or err}"))
        sys.exit(PlannerError.exit_code)


if __name__ == "__main__":
    main()
