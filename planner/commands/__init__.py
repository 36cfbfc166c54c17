"""CLI command modules; each has `register(app)`. Order here is the order in `planner --help`."""

from planner.commands import plan_cmds

COMMAND_MODULES = [plan_cmds]
