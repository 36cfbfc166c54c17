"""Pure estimators over the `plans` specs: time in seconds, memory in bytes.

The planner calls `CostModel`; everything here is deterministic and torch-free.
"""

from cost_models.api import CallCost, CostModel, ReallocCost

__all__ = ["CallCost", "CostModel", "ReallocCost"]
