"""Pure estimators over the `plans` specs: time in seconds, memory in bytes.

The planner calls `CostModel`; everything here is deterministic and torch-free.
"""

from cost_models.api import CallCost, CostModel, ReallocCost, matmul_params, model_flops
from cost_models.calibration import Calibration, default_calibration, load_calibration, save_calibration
from cost_models.framework import FRAMEWORKS, Framework

__all__ = [
    "FRAMEWORKS", "Calibration", "CallCost", "CostModel", "Framework", "ReallocCost", "default_calibration",
    "load_calibration", "matmul_params", "model_flops", "save_calibration",
]
