"""CLI command modules; each has `register(app)`. Order here is the order in `planner --help`."""

from planner.commands import cost_cmds, observe_cmds, plan_cmds, reliability_cmds

COMMAND_MODULES = [plan_cmds, observe_cmds, cost_cmds, reliability_cmds]
