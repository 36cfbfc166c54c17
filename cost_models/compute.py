"""Kernel times: GEMMs by a roofline with wave quantisation, memory-bound kernels by bytes.

A GEMM's output is cut into tiles, one per streaming multiprocessor at a time; the last wave runs
partly empty, so a GEMM of T tiles on S SMs reaches ``T / (S * ceil(T / S))`` of the SMs, and
edge tiles that overhang the matrix compute padding. The kernel then takes the longer of its
compute time at that efficiency and its operand traffic over HBM (the roofline: short-K GEMMs
such as attention scores with K = head_dim are bandwidth-bound), plus a launch latency. Tile shapes and their relative throughput follow the arithmetic intensity
of the tile (cuBLAS picks the best for the shape; we do the same over a small menu).
"""

from __future__ import annotations

from functools import lru_cache

from cost_models.attention import PROFILE_HEAD_DIM, PROFILE_HEADS, PROFILE_SEQ, attention_share
from cost_models.hardware import Hardware
from cost_models.ops import Kernel

# (rows, cols, relative throughput): smaller tiles load more operand bytes per FLOP, which
# bounds them below peak by their arithmetic intensity 2*r*c/(r+c) relative to 128x128's.
TILES: tuple[tuple[int, int, float], ...] = ((128, 128, 1.0), (128, 64, 0.85), (64, 128, 0.85), (64, 64, 0.6))
ATTN_QUERY_TILE = 128  # query rows per tile of FlashAttention-2/3's and cuDNN's forward kernels


@lru_cache(maxsize=65536)
def wave_efficiency(m: int, n: int, batch: int, sm_count: int | None) -> float:
    """Best fraction of the SMs busy over the waves of an (m x n) x batch GEMM's output tiles."""
    if sm_count is None:
        return 1.0
    best = 0.0
    for r, c, rel in TILES:
        tiles = -(-m // r) * -(-n // c) * batch
        waves = -(-tiles // sm_count)
        best = max(best, rel * tiles / (waves * sm_count) * (m * n) / (-(-m // r) * r * -(-n // c) * c))
    return best


def sm_fill(tiles: int, sm_count: int | None) -> float:
    """The share of the SMs `tiles` equal tiles keep busy over their waves."""
    if sm_count is None:
        return 1.0
    return tiles / (-(-tiles // sm_count) * sm_count)


def attention_anchor(kernel: str, arch: str, *, measured_flops: float, peak_flops: float, sm_count: int | None) -> float:
    """The factor that puts `kernel`'s published curve through a GPU profile's measured forward rate
    at its own shape (`PROFILE_HEADS` heads of `PROFILE_SEQ` causal tokens, head dim
    `PROFILE_HEAD_DIM`), the SMs that shape's tiles leave idle included."""
    share = attention_share(kernel, arch, d=PROFILE_HEAD_DIM, keys=(PROFILE_SEQ + 1) / 2, passes=1.0)
    fill = sm_fill(-(-PROFILE_SEQ // ATTN_QUERY_TILE) * PROFILE_HEADS, sm_count)
    return measured_flops / (peak_flops * share * fill)


def kernel_time_s(k: Kernel, hw: Hardware) -> float:
    """Device time of one kernel on `hw`."""
    latency = k.launches * hw.kernel_latency_s
    if k.kind == "mem":
        return k.bytes / hw.elementwise_bytes_s + latency
    if k.kind == "gemm":
        # Launches run one after another fill the SMs with their own share of the batch each.
        batch = max(1, k.batch // k.launches) if k.serial else k.batch
        rate = hw.gemm_flops * wave_efficiency(k.m, k.n, batch, hw.sm_count)
        return max(k.flops / rate, k.bytes / hw.mem_bytes_s) + latency
    # Fused attention: one tile per (head, query block); the key loop is the reduction. Where the
    # online softmax is not hidden under the matmuls (a CPU core runs them in turn), each
    # (sequence, head) pair adds its setup and each score its exponential, in every pass.
    if hw.attn_kernel is not None and k.m >= ATTN_QUERY_TILE:
        # Its published speed at this head dim and keys per query (measured on shapes that fill the
        # GPU; anchored to a profile's measurement where there is one) under its ceiling, times the
        # share of the SMs the (sequence, head, 128-query block) tiles keep busy over their waves.
        # Queries that fill no block (decode: one per sequence) are outside what was published and
        # keep the calibration's rate below, padded to a tile.
        keys = k.scores / max(1, k.batch * k.m)
        share = attention_share(hw.attn_kernel, hw.arch, d=k.k, keys=keys, passes=k.passes)
        rate = min(hw.attn_cap_flops, hw.peak_flops * share * hw.attn_anchor) \
            * sm_fill(-(-k.m // ATTN_QUERY_TILE) * k.batch, hw.sm_count)
    else:
        rate = hw.attn_flops * wave_efficiency(k.m, 64, k.batch, hw.sm_count)
    softmax_s = k.passes * (k.batch * hw.attn_head_s + k.scores * hw.attn_score_s)
    return max(k.flops / rate, k.bytes / hw.mem_bytes_s) + softmax_s + latency


def kernels_time_s(kernels: tuple[Kernel, ...], hw: Hardware) -> float:
    """Device time of kernels run back to back."""
    return sum(kernel_time_s(k, hw) for k in kernels)


def host_device_s(host_s: float, device_s: float, hw: Hardware) -> float:
    """Wall time of a stretch whose host issues work for `host_s` while the device needs `device_s`.

    The host runs ahead of the device through the launch queue, so the longer of the two bounds
    the stretch; the shorter is hidden under it only in part (`host_overlap`), as the device
    starves whenever the host falls behind within the stretch.
    """
    longer, shorter = (host_s, device_s) if host_s > device_s else (device_s, host_s)
    return longer + (1.0 - hw.host_overlap) * shorter
