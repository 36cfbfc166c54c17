"""Trained models out: each trainable model of a run written as an HF directory (``--save-hf DIR``).

``DIR/<model>/`` gets ``config.json`` (the model's own directory's, or one built from its spec;
weights in fp32), the consolidated weights (``model.safetensors``, or ``model-0000K-of-0000N``
files and ``model.safetensors.index.json`` above `--save-hf-shard-mb`), and the tokenizer files
of the directory the model started from. ``transformers.AutoModelForCausalLM.from_pretrained``
(or ``AutoModelForSequenceClassification`` for a value head) loads it.

Rank 0 assembles each tensor from the shards of the model's home placement: parameter by
parameter, in catalog order, each distinct box's first holder (`plans.checkpoint.shard_writers`)
sends it to rank 0, which writes a file whenever the tensors collected reach the shard size, so
its memory holds one output file at a time, never the whole model. The directory is written as
``DIR/<model>.tmp`` and renamed into place: a save is complete or absent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from plans.base import loads_json
from plans.checkpoint import shard_writers
from plans.errors import PlannerError
from plans.io import check_output, replace_directory, write_bytes_atomic, write_text_atomic
from plans.sharding import parameters, shard_box
from runtime.executor import PlanRunner
from runtime.faults import SharedError, named
from runtime.weights import INDEX_NAME, TOKENIZER_FILES, hf_config, hf_tensors, hf_type_of

DEFAULT_SHARD_MB = 5000  # transformers' default max_shard_size (5 GB)


def check_save_dir(directory: Path) -> None:
    """A `PlannerError` now, before the run, if `directory` cannot hold the saved models."""
    if directory.exists() and (directory.is_symlink() or not directory.is_dir()):
        raise PlannerError(f"--save-hf {str(directory)!r} exists and is not a directory",
                           hint="give a directory (it is created if missing)")
    check_output(directory / "model.safetensors")


def _base_config(weights: str | None) -> dict | None:
    if weights is None:
        return None
    path = Path(weights) / "config.json"
    data = loads_json(path.read_text(encoding="utf-8"), source=f"model config {str(path)!r}")
    return data if isinstance(data, dict) else None


def _whole_tensors(runner: PlanRunner, model: str):  # noqa: ANN202 (a generator of (name, tensor | None))
    """(parameter name, its whole tensor on rank 0 or None elsewhere), in catalog order; every
    rank takes part (the holders send their boxes point to point)."""
    decl = runner.plan.models[model]
    where = next(w for m, w, _ in runner.resident() if m == model)
    held = runner.homes.get(model)
    writers = shard_writers(decl.spec, head=decl.head, mesh=where.mesh, layout=where.layout)
    for param in parameters(decl.spec, head=decl.head):
        whole = torch.empty(param.shape, dtype=torch.float32, device=runner.device) if runner.rank == 0 else None
        mine = held.shard.params.get(param.name) if held is not None else None
        my_box = shard_box(param, decl.spec, where.layout, held.groups.local) if held is not None else None
        for box, rank in sorted(writers[param.name].items()):
            index = tuple(slice(lo, hi) for lo, hi in box)
            if rank == runner.rank and runner.rank == 0:
                assert mine is not None and my_box == box
                whole[index] = mine.detach().float()  # type: ignore[index]
            elif rank == runner.rank:
                assert mine is not None and my_box == box
                dist.send(mine.detach().float().contiguous(), dst=0)
            elif runner.rank == 0:
                part = torch.empty(tuple(hi - lo for lo, hi in box), dtype=torch.float32, device=runner.device)
                dist.recv(part, src=rank)
                whole[index] = part  # type: ignore[index]
        yield param.name, (whole.cpu() if whole is not None else None)


def _write_files(directory: Path, tensors: dict[str, Tensor], *, shard_bytes: int) -> None:
    """The safetensors file(s) and, when sharded, their index (transformers' naming)."""
    from safetensors.torch import save

    groups: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][key] = t
        size += n
    if len(groups) == 1:
        write_bytes_atomic(directory / "model.safetensors", save(groups[0], metadata={"format": "pt"}))
        return
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        write_bytes_atomic(directory / name, save(group, metadata={"format": "pt"}))
        weight_map.update({key: name for key in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_text_atomic(directory / INDEX_NAME, json.dumps({"metadata": {"total_size": total},
                                                          "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")


def _save_model(runner: PlanRunner, model: str, target: Path, *, shard_bytes: int) -> None:
    decl = runner.plan.models[model]
    state = {}
    with named(f"saving {model!r} as an HF directory", rank=runner.rank, timeout_s=runner.timeout_s):
        for name, whole in _whole_tensors(runner, model):
            if whole is not None:
                state[name] = whole
    if runner.rank != 0:
        return
    base = _base_config(decl.weights)
    hf_type = hf_type_of(decl.spec, base)
    tmp = target.with_name(target.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _write_files(tmp, hf_tensors(decl.spec, state, hf_type=hf_type), shard_bytes=shard_bytes)
        cfg = hf_config(decl.spec, head=decl.head, base=base)
        write_text_atomic(tmp / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if decl.weights is not None:
            for name in TOKENIZER_FILES:
                src = Path(decl.weights) / name
                if src.is_file() and not src.is_symlink():
                    write_bytes_atomic(tmp / name, src.read_bytes())
        replace_directory(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PlannerError(f"cannot write the HF directory {str(target)!r}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_hf(runner: PlanRunner, directory: Path, *, shard_mb: float = DEFAULT_SHARD_MB) -> list[Path]:
    """Write every trainable model of the run as ``directory/<model>`` (every rank calls it);
    returns the directories written. A failure on rank 0 is a `PlannerError` on every rank."""
    written = []
    for model, decl in runner.plan.models.items():
        if not decl.trainable or not any(m == model for m, _, _ in runner.resident()):
            continue
        target = directory / model
        error: tuple[str, str | None] | None = None
        try:
            _save_model(runner, model, target, shard_bytes=int(shard_mb * 2**20))
        except PlannerError as e:
            error = (e.message, e.hint)
        if runner.distributed:  # rank 0's problem on every rank (a rank's own failure stays its own)
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0] or error
        if error is not None:
            raise SharedError(error[0], hint=error[1])
        written.append(target)
    return written
