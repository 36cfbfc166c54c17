"""Fused attention speed by kernel, architecture, head dimension and keys, from published benchmarks.

A fused attention kernel gives each (sequence, head, query block) to one SM, which loops over the
key blocks. Loading the query block, the final rescale and writing the output are paid once per
query block whatever the number of keys, so short sequences run below the kernel's long-sequence
speed: over k keys per query, ``rate(k) = R * k / (k + k0)``, k0 the keys whose time that fixed
part costs. R and k0 are fitted (least squares of 1/rate on 1/k) to each published curve below;
the form reproduces them within 4% (FlashAttention-3's forward within 5.5%, the Triton kernel's,
whose published speed dips at 4k, within 6.7%; `tests/test_attention_curves.py`) and carries past
their 16k end to longer contexts without running away. Below one query block per (sequence, head),
as in decode, nothing is published: those kernels keep the calibration's rate
(`cost_models.compute`).

Published curves, TFLOP/s, causal, at sequence 512, 1k, 2k, 4k, 8k, 16k (batch x sequence = 16k
tokens, hidden 2048, FLOPs counting the causal half and the backward as 2.5 forwards:
flash-attention's `benchmarks/benchmark_flash_attention.py`):

- FlashAttention-2 forward+backward on an A100 80GB SXM4 and an H100 80GB SXM5: the
  flash-attention repository's `assets/flash2_a100_fwd_bwd_benchmark.png` and
  `assets/flash2_h100_fwd_bwd_benchmark.png` (Dao 2023, arXiv:2307.08691), panels (c) and (d);
  the A100 figure's bars for FlashAttention (version 1) and FlashAttention in Triton too.
- FlashAttention-2, cuDNN and FlashAttention-3 forward on an H100: `assets/flash3_fp16_fwd.png`
  (Shah et al. 2024, arXiv:2407.08608), panels (b) and (d).
- cuDNN forward+backward on an H100 is not published with a causal mask; it is taken as
  FlashAttention-2's forward+backward times cuDNN's forward speed-up over FlashAttention-2 at the
  same length (1.25-1.30x at head dim 64, 1.58-1.65x at 128). The FlashAttention-3 paper's
  backward figure (without a causal mask) shows cuDNN's backward ahead of FlashAttention-2's by
  about the same factor.

A benchmark point of sequence s has (s + 1) / 2 keys per query on average (the causal half). A
forward kernel runs at the forward curve where one is published, and the backward at what the
forward+backward time leaves: ``2.5 / (3.5 / fwd_bwd - 1 / fwd)``. Head dimensions between 64 and
128 interpolate linearly; below 64 or above 128 take the nearer curve. Another GPU of the
architecture runs at the same share of its own datasheet peak as the benchmarked one did.

Which kernel a stack runs on which architecture is its `Framework.attention_kernels`: Transformer
Engine (Megatron-core, NeMo) prefers cuDNN's fused attention on Hopper and FlashAttention-2 on
Ampere (NVIDIA NeMo, docs `memory_optimizations.rst`, PR #9188); PyTorch's SDPA runs
FlashAttention-2 on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cost_models.ops import FLASH_BWD_FLOPS_RATIO
from plans.hardware import gpu_spec

SEQS = (512, 1024, 2048, 4096, 8192, 16384)
# What `planner profile` times on a GPU: one causal forward through PyTorch's SDPA, batch 1. A
# profile's measured rate anchors the stack's curve at that point (`compute.attention_anchor`),
# so its attention keeps the published shape by length at the measured level.
PROFILE_HEADS, PROFILE_SEQ, PROFILE_HEAD_DIM = 16, 2048, 128
# (kernel, arch) -> benchmarked GPU preset, and per head dim: (forward+backward, forward or None)
PUBLISHED: dict[tuple[str, str], tuple[str, dict[int, tuple[tuple[float, ...] | None, tuple[float, ...] | None]]]] = {
    ("fa2", "ampere"): ("a100-80gb", {
        64: ((88, 119, 140, 156, 165, 171), None),
        128: ((99, 133, 155, 173, 182, 189), None),
    }),
    ("fa2", "hopper"): ("h100-sxm", {
        64: ((141, 192, 232, 257, 273, 284), (180, 229, 262, 284, 295, 299)),
        128: ((163, 221, 265, 294, 308, 328), (191, 260, 298, 319, 333, 335)),
    }),
    ("cudnn", "hopper"): ("h100-sxm", {
        64: (None, (225, 288, 334, 363, 379, 388)),
        128: (None, (315, 410, 484, 518, 529, 539)),
    }),
    # FlashAttention in Triton (the 2022 kernel in flash-attention's repository, which llm-foundry's
    # `attn_impl: triton` ran), forward+backward on an A100: the same A100 figure. No preset runs it.
    ("triton-fa", "ampere"): ("a100-80gb", {
        64: ((59, 75, 79, 76, 79, 80), None),
        128: ((50, 61, 68, 74, 78, 80), None),
    }),
    # FlashAttention (version 1) forward+backward on an A100, the same figure's FlashAttention bars;
    # the kernel flash-attention's own training scripts ran in 2022 (`bench/cost_accuracy.py`).
    # No preset runs it.
    ("fa1", "ampere"): ("a100-80gb", {
        64: ((58, 70, 77, 87, 92, 97), None),
        128: ((55, 62, 69, 76, 80, 83), None),
    }),
    ("fa3", "hopper"): ("h100-sxm", {
        64: (None, (197, 265, 371, 420, 460, 473)),
        128: (None, (292, 423, 521, 579, 602, 616)),
    }),
}
KERNEL_NAMES = {"fa2": "FlashAttention-2", "cudnn": "cuDNN fused attention", "fa3": "FlashAttention-3",
                "triton-fa": "FlashAttention in Triton", "fa1": "FlashAttention"}
# cuDNN's forward+backward: FlashAttention-2's scaled by cuDNN's forward speed-up at each length.
DERIVED_FROM = {"cudnn": "fa2"}


@dataclass(frozen=True)
class Curve:
    """rate(k) = peak_share * k / (k + k0) of a GPU's peak, over k keys per query."""

    share: float  # long-sequence speed as a share of the benchmarked GPU's peak
    k0: float

    def at(self, keys: float) -> float:
        return self.share * keys / (keys + self.k0)


def fit_curve(points: tuple[float, ...], peak_tflops: float) -> Curve:
    """Least squares of 1/rate on 1/k over the published points (k = (s + 1) / 2 keys per query)."""
    xs = [2.0 / (s + 1) for s in SEQS]
    ys = [1.0 / r for r in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return Curve(share=1.0 / intercept / peak_tflops, k0=slope / intercept)


def _fwd_bwd_points(kernel: str, arch: str, d: int) -> tuple[float, ...] | None:
    """The published (or derived) forward+backward points; None for a forward-only kernel."""
    _, dims = PUBLISHED[(kernel, arch)]
    fb, fwd = dims[d]
    if fb is not None:
        return fb
    base = DERIVED_FROM.get(kernel)
    if base is None or fwd is None:
        return None
    base_fb, base_fwd = PUBLISHED[(base, arch)][1][d]
    assert base_fb is not None and base_fwd is not None
    return tuple(b * f / bf for b, f, bf in zip(base_fb, fwd, base_fwd))


@lru_cache(maxsize=None)
def curves(kernel: str, arch: str, d: int) -> tuple[Curve | None, Curve | None]:
    """(forward+backward, forward) curves of `kernel` on `arch` at a benchmarked head dim; the
    forward+backward one is None where the kernel only runs forward (FlashAttention-3 in vLLM)."""
    gpu, dims = PUBLISHED[(kernel, arch)]
    peak = gpu_spec(gpu).peak_tflops
    fb, fwd = _fwd_bwd_points(kernel, arch, d), dims[d][1]
    return (fit_curve(fb, peak) if fb is not None else None), (fit_curve(fwd, peak) if fwd is not None else None)


def has_curves(kernel: str, arch: str) -> bool:
    return (kernel, arch) in PUBLISHED


def attention_share(kernel: str, arch: str, *, d: int, keys: float, passes: float) -> float:
    """Of the GPU's peak, what `kernel` reaches on `arch` in a forward (`passes` 1) or backward
    kernel at head dim `d` with `keys` keys per query."""
    dims = sorted(PUBLISHED[(kernel, arch)][1])
    lo, hi = dims[0], dims[-1]
    if d <= lo or d >= hi:
        return _share_at(kernel, arch, lo if d <= lo else hi, keys, passes)
    w = (d - lo) / (hi - lo)
    return (1 - w) * _share_at(kernel, arch, lo, keys, passes) + w * _share_at(kernel, arch, hi, keys, passes)


def _share_at(kernel: str, arch: str, d: int, keys: float, passes: float) -> float:
    fb, fwd = curves(kernel, arch, d)
    keys = max(keys, 1.0)
    forward = passes == 1.0
    if fb is None:  # a forward-only kernel's backward (never run by the stacks that use it): FlashAttention-2's
        if forward and fwd is not None:
            return fwd.at(keys)
        return _share_at("fa2", arch, d, keys, passes)
    if fwd is None:
        return fb.at(keys)
    f, t = fwd.at(keys), fb.at(keys)
    if forward:
        return f
    # backward: what the forward+backward time (1 + r forward FLOPs at t) leaves after the forward's
    r = FLASH_BWD_FLOPS_RATIO
    return r / max((1.0 + r) / t - 1.0 / f, r / f)
