"""The torch runtime: executes a compiled plan under torchrun (gloo on CPU, NCCL on GPUs).

Imports `plans/` only (never `planner/`, `cost_models/` or ortools). Read in this order:

- `model`: the decoder (llama / gpt, LM or value head) over one rank's parameter slices, HF names
  and HF-format safetensors checkpoints;
- one module per parallel technique: `tensor_parallel`, `pipeline_parallel`, `data_parallel`
  (ZeRO 0-3), `recompute`; `groups` builds their process groups from a plan's mesh and layout;
- `engine`: `parallelize` composes them in one documented order; `ModelRunner` runs train /
  inference / generate (`generate`) on a shard;
- `losses` and `algorithms` (PPO, GRPO, RLOO, ReMax, DPO, SFT glue, rewards on text), `tasks`
  (toy data and rewards), `data` (tokenizers and dataset files), `weights` (HF model directories
  in, slice by slice) and `save_hf` (trained models out as HF directories);
- `realloc` (moving a model's parameters between two placements, exactly the transfer plan of
  `plans.sharding`), `dataflow` (call outputs and statistics between ranks, point to point),
  `executor` (walks the plan's calls: parameters from each model's home placement, reallocated
  copies, data), `__main__` (the command line);
- `session`: a training loop traced by `planner.auto`, run again with live handles: its calls
  through the executor in the loop's order, its host steps as written;
- `checkpoint` and `stfile` (checkpoints saved and verified), `trusted` (the only code a run
  imports besides its own: what the launch names), `process` (signals, an orphaned rank, threads,
  the machine).
"""
