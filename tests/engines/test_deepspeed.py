"""DeepSpeed 0.19.8 accepts every export: `DeepSpeedConfig` (the parser and checks
`deepspeed.initialize` runs) takes the exported JSON with the world the job has, and keeps the
plan's ZeRO stage, precision and batch.

Stubbed, because they need a cluster: the process group's size (one gloo process stands in; its
`get_world_size` returns the job's process count) and, for pipelined layouts, the
`PipelineModule` grid (an mpu giving its data-parallel size), which DeepSpeed reads instead of the
process group."""

from __future__ import annotations

import pytest
from conftest import DataParallelWorld, exports, ids, load, plan_of

EXPORTS = exports("deepspeed")
pytestmark = pytest.mark.usefixtures("deepspeed_process_group")


@pytest.mark.parametrize("path", EXPORTS, ids=ids(EXPORTS))
def test_deepspeed_config_accepts_each_export(path, monkeypatch) -> None:  # noqa: ANN001
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    doc = load(path)
    plan = plan_of(path)
    call = next(c for c in plan["calls"] if c["name"] == path.name.split(".")[2])
    lay = call["layout"]
    if "refused" in doc:
        assert lay["pp"] > 1 and (lay["tp"] > 1 or lay["cp"] > 1) or lay["tp"] > 1 and lay["cp"] > 1, doc["refused"]
        return
    processes = len(call["mesh"]["ranks"])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: processes)
    mpu = DataParallelWorld(processes // (lay["pp"] * lay["tp"])) if lay["pp"] > 1 else None
    cfg = DeepSpeedConfig(doc["settings"], mpu=mpu)
    assert cfg.zero_optimization_stage == lay["zero"]
    if lay["zero"] >= 1:  # the plan prices the gradient reduction under the backward
        assert cfg.zero_config.overlap_comm is True
    assert cfg.bfloat16_config.enabled if hasattr(cfg, "bfloat16_config") else cfg.bfloat16_enabled
    per_step = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * lay["dp"]
    minibatches = call.get("minibatches", 1)
    assert per_step == call["seqs"] // minibatches, "sequences per optimizer step differ from the plan's"
