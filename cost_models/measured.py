"""Measured training runs (CSV) and the cost model's predictions of them.

A measured-runs CSV has one training configuration per row and its measured iteration time. The
column names of the vTrain data set are accepted as they are (``hidden size``, ``# layers``,
``tensor parallelism``, ``iteration time (ms)``, ...), as are the snake-case names below. Columns a
file lacks take the defaults given to `read_measured` (the vTrain rows are Megatron-LM's GPT, run
on Megatron-DeepSpeed, with vocabulary 51,200 and full recompute).

Required: hidden_size, num_attention_heads, num_hidden_layers, seq_len, global_batch, micro_batch,
tp, dp, pp, iteration_ms. Optional: gpus (default tp*dp*pp), model_type, vocab_size,
intermediate_size, num_key_value_heads, recompute, zero, sequence_parallel, cp, interleave,
params_b (a label for grouping).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from plans.cluster import ClusterSpec
from plans.errors import PlannerError
from plans.layout import Layout
from plans.model import ModelSpec, resolve_model

ALIASES = {
    "parameters (billion)": "params_b",
    "# gpus": "gpus",
    "global batch": "global_batch",
    "micro batch": "micro_batch",
    "hidden size": "hidden_size",
    "attention heads": "num_attention_heads",
    "# layers": "num_hidden_layers",
    "sequence length": "seq_len",
    "tensor parallelism": "tp",
    "data parallelism": "dp",
    "pipeline parallelism": "pp",
    "iteration time (ms)": "iteration_ms",
}
REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "seq_len", "global_batch", "micro_batch",
            "tp", "dp", "pp", "iteration_ms")


@dataclass(frozen=True)
class MeasuredRun:
    """One measured training configuration."""

    source: str  # file:line
    spec: ModelSpec
    layout: Layout
    global_batch: int
    seq_len: int
    gpus: int
    iteration_s: float
    label: str  # model size label for grouping, e.g. "3.6B"

    def cluster(self, *, gpu: str, gpus_per_node: int, intra_node_gbps: float | None,
                inter_node_gbps: float | None) -> ClusterSpec:
        """The smallest cluster of whole nodes that holds the run."""
        nodes = -(-self.gpus // gpus_per_node)
        return ClusterSpec(gpu=gpu, nodes=nodes, gpus_per_node=gpus_per_node, intra_node_gbps=intra_node_gbps,
                           inter_node_gbps=inter_node_gbps)


def _int(row: dict[str, str], key: str, where: str, default: int | None = None) -> int:
    raw = row.get(key, "")
    if raw == "" and default is not None:
        return default
    try:
        return int(float(raw))
    except (ValueError, OverflowError):  # not a number, NaN, or infinite
        raise PlannerError(f"{where}: column {key!r} must be a number, got {raw!r}") from None


def _positive(row: dict[str, str], key: str, where: str) -> float:
    raw = row.get(key, "")
    try:
        value = float(raw)
    except ValueError:
        raise PlannerError(f"{where}: column {key!r} must be a number, got {raw!r}") from None
    if not 0 < value < float("inf"):
        raise PlannerError(f"{where}: column {key!r} must be a positive, finite number, got {raw!r}")
    return value


def read_measured(path: str | Path, *, model_type: str = "gpt", vocab_size: int = 51200,
                  recompute: str = "full") -> list[MeasuredRun]:
    """Read a measured-runs CSV, or raise a `PlannerError` naming the file, line and column."""
    p = Path(path)
    if p.is_dir():
        raise PlannerError(f"measured-runs file {str(p)!r} is a directory", hint="give the CSV file itself")
    if not p.is_file():
        raise PlannerError(f"measured-runs file {str(p)!r} does not exist")
    try:
        return _read_rows(p, model_type=model_type, vocab_size=vocab_size, recompute=recompute)
    except UnicodeDecodeError as e:
        raise PlannerError(f"measured-runs file {str(p)!r} is not a UTF-8 text (CSV) file: {e.reason} at byte {e.start}") from None
    except csv.Error as e:
        raise PlannerError(f"measured-runs file {str(p)!r} is not a readable CSV file: {e}") from None
    except OSError as e:
        raise PlannerError(f"cannot read measured-runs file {str(p)!r}: {e.strerror or e}") from None


def _read_rows(p: Path, *, model_type: str, vocab_size: int, recompute: str) -> list[MeasuredRun]:
    with p.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [ALIASES.get(h.strip().lower(), h.strip().lower()) for h in (reader.fieldnames or [])]
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise PlannerError(f"measured-runs file {str(p)!r} lacks columns {', '.join(missing)}",
                               hint="see `cost_models.measured` for the accepted column names")
        runs = []
        for line, raw in enumerate(reader, start=2):
            row = {ALIASES.get(k.strip().lower(), k.strip().lower()): (v or "").strip() for k, v in raw.items() if k}
            where = f"{p.name}:{line}"
            tp, dp, pp = _int(row, "tp", where), _int(row, "dp", where), _int(row, "pp", where)
            cp = _int(row, "cp", where, 1)
            gb, mb = _int(row, "global_batch", where), _int(row, "micro_batch", where)
            for key, value in (("tp", tp), ("dp", dp), ("pp", pp), ("cp", cp), ("global_batch", gb), ("micro_batch", mb)):
                if value < 1:
                    raise PlannerError(f"{where}: column {key!r} must be at least 1, got {value}")
            if gb % (dp * mb):
                raise PlannerError(f"{where}: global batch {gb} does not split into dp {dp} x micro batch {mb}")
            fields = {"model_type": row.get("model_type") or model_type, "hidden_size": _int(row, "hidden_size", where),
                      "num_hidden_layers": _int(row, "num_hidden_layers", where),
                      "num_attention_heads": _int(row, "num_attention_heads", where),
                      "vocab_size": _int(row, "vocab_size", where, vocab_size),
                      "max_position_embeddings": max(2048, _int(row, "seq_len", where))}
            for opt in ("intermediate_size", "num_key_value_heads"):
                if row.get(opt):
                    fields[opt] = _int(row, opt, where)
            spec = resolve_model(fields)
            try:
                layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, micro_batches=gb // (dp * mb),
                                recompute=row.get("recompute") or recompute, zero=_int(row, "zero", where, 0),
                                sequence_parallel=row.get("sequence_parallel", "").lower() in ("1", "true", "yes"),
                                interleave=_int(row, "interleave", where, 1))
            except ValueError as e:
                raise PlannerError(f"{where}: {e}") from None
            ms = _positive(row, "iteration_ms", where)
            label = f"{_positive(row, 'params_b', where):g}B" if row.get("params_b") else \
                f"h{spec.hidden_size}-l{spec.num_hidden_layers}"
            runs.append(MeasuredRun(where, spec, layout, gb, _int(row, "seq_len", where),
                                    _int(row, "gpus", where, tp * dp * pp * cp), ms / 1e3, label))
    if not runs:
        raise PlannerError(f"measured-runs file {str(p)!r} has no rows")
    return runs
