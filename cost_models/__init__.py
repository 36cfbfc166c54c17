"""Pure estimators over the `plans` specs: time in seconds, memory in bytes.

The planner calls `CostModel` (`api`); everything here is deterministic and torch-free.

- `ops`: the kernels (GEMM shapes after tensor-parallel splitting, memory-bound bytes) and
  collectives of a decoder layer, the embedding and the head, for both model families;
- `compute`: kernel times (roofline with wave quantisation) and host/device overlap;
- `comm`: alpha-beta collectives over the real topology;
- `training`: a train step (1F1B / interleaved pipeline, recompute, gradient reduction, ZeRO,
  optimizer) and a forward-only pass; `generation`: prefill and decode;
- `memory`: model states (ZeRO), activations (Korthikanti et al.), KV cache, buffers;
- `calibration`, `framework`, `hardware`: fitted coefficients, software-stack traits, and the
  effective hardware they combine into; `fit` and `measured`: calibration against measured runs;
- `estimate`: one training configuration checked and estimated (`planner estimate`);
- `transfer`: per-rank reallocation volumes from the layout algebra.
"""

from cost_models.api import CallCost, CostModel, ReallocCost, matmul_params, model_flops
from cost_models.calibration import Calibration, default_calibration, load_calibration, save_calibration
from cost_models.framework import FRAMEWORKS, Framework

__all__ = [
    "FRAMEWORKS", "Calibration", "CallCost", "CostModel", "Framework", "ReallocCost", "default_calibration",
    "load_calibration", "matmul_params", "model_flops", "save_calibration",
]
