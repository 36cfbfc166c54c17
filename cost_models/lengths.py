"""How many decode steps a batch of responses takes, and how many of its rows are still running.

A generate call caps every response at ``gen_len``, but responses stop early at the end-of-sequence
token. Its cost then depends on the distribution of the lengths L (`plans.graph.ResponseLengths`):

- a batch of b rows decodes until its longest response ends: ``E[max of b lengths]`` steps,
  ``sum_{k >= 0} (1 - F(k)^b)`` over the lengths' distribution function F (rows are independent);
- at step k, ``b * P(L >= k)`` rows are still running: an engine that drops finished rows from
  its batch (vLLM's continuous batching) runs each step at that many rows; the planner's runtime
  keeps every row of a batch to its end (a finished row's tokens are masked), so its steps all run
  at b rows.

Given only the mean m, the lengths are taken as geometric, capped at gen_len: a constant chance p
of stopping at each token (an EOS probability that does not depend on the position), with p
solved so that ``E[min(Geom(p), gen_len)] = m``. Given samples, their empirical distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plans.graph import ResponseLengths

SEGMENTS = 4  # decode steps are priced in this many stretches of equal length at their mean running rows


@dataclass(frozen=True)
class LengthDist:
    """The distribution of generated tokens per response, over 1..cap."""

    cap: int
    cdf: tuple[float, ...]  # cdf[k] = P(L <= k), k = 0..cap (cdf[0] = 0, cdf[cap] = 1)

    @property
    def mean(self) -> float:
        return float(np.sum(1.0 - np.asarray(self.cdf[:-1])))

    def expected_max(self, rows: int) -> float:
        """Expected longest of `rows` independent responses."""
        return _expected_max(self, max(1, rows))

    def running(self, steps: np.ndarray) -> np.ndarray:
        """P(L >= k) for each step k of `steps` (1-based): the share of rows still generating
        their k-th token."""
        cdf = np.asarray(self.cdf)
        return 1.0 - cdf[np.clip(steps - 1, 0, self.cap)]


@lru_cache(maxsize=4096)
def _expected_max(dist: LengthDist, rows: int) -> float:
    cdf = np.asarray(dist.cdf[:-1], dtype=np.float64)
    return float(np.sum(1.0 - cdf ** rows))


def geometric(mean: float, cap: int) -> LengthDist:
    """Lengths min(Geom(p), cap) with the given mean (all of them cap when mean >= cap)."""
    if mean >= cap:
        return LengthDist(cap, (0.0,) * cap + (1.0,))
    if mean <= 1.0:
        return LengthDist(cap, (0.0,) + (1.0,) * cap)

    def capped_mean(p: float) -> float:  # E[min(Geom(p), cap)] = (1 - (1-p)^cap) / p
        return (1.0 - (1.0 - p) ** cap) / p

    lo, hi = 1e-12, 1.0  # capped_mean falls from cap (p -> 0) to 1 (p = 1)
    for _ in range(200):
        mid = (lo + hi) / 2
        if capped_mean(mid) > mean:
            lo = mid
        else:
            hi = mid
    p = (lo + hi) / 2
    k = np.arange(cap + 1, dtype=np.float64)
    cdf = 1.0 - (1.0 - p) ** k
    cdf[-1] = 1.0
    return LengthDist(cap, tuple(float(x) for x in cdf))


def empirical(samples: tuple[int, ...], cap: int) -> LengthDist:
    """The samples' own distribution (each clipped to 1..cap)."""
    counts = np.bincount(np.clip(np.asarray(samples, dtype=np.int64), 1, cap), minlength=cap + 1)
    cdf = np.cumsum(counts) / counts.sum()
    cdf[-1] = 1.0
    return LengthDist(cap, tuple(float(x) for x in cdf))


@lru_cache(maxsize=1024)
def length_dist(lengths: ResponseLengths | None, cap: int) -> LengthDist | None:
    """The distribution a call's `response_len` describes (None: every response runs to `cap`)."""
    if lengths is None:
        return None
    if lengths.samples:
        return empirical(lengths.samples, cap)
    return geometric(float(lengths.mean), cap)  # type: ignore[arg-type]


def decode_segments(dist: LengthDist | None, *, cap: int, rows: int, drops_finished: bool) -> list[tuple[float, float, int]]:
    """The decode steps of a batch of `rows` (after the prefill's first token), as stretches of
    (steps, mean generated length so far, running rows): every step of a stretch is priced at its
    running rows and the context at its middle."""
    if dist is None:
        return [(float(cap - 1), (cap + 1) / 2, rows)]
    steps = max(0.0, dist.expected_max(rows) - 1.0)
    if not drops_finished or steps == 0:
        return [(steps, (steps + 2) / 2, rows)]
    out = []
    edges = np.linspace(2.0, steps + 2.0, SEGMENTS + 1)
    for a, b in zip(edges[:-1], edges[1:]):
        ks = np.arange(int(np.ceil(a)), int(np.ceil(b)))
        if len(ks) == 0:
            continue
        share = float(np.mean(dist.running(ks)))
        running = max(1, int(np.ceil(rows * share)))
        out.append((float(b - a), float((a + b) / 2), running))
    return out
