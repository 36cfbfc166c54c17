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


def decode_segments(dist: LengthDist | None, *, cap: int, rows: int, drops_finished: bool,
                    longest_of: int | None = None) -> list[tuple[float, float, int]]:
    """The decode steps of a batch of `rows` (after the prefill's first token), as stretches of
    (steps, mean generated length so far, running rows): every step of a stretch is priced at its
    running rows and the context at its middle. `longest_of`: the batch holds the longest of that
    many responses (the slowest of several batches; default `rows`), which sets its steps."""
    if dist is None:
        return [(float(cap - 1), (cap + 1) / 2, rows)]
    steps = max(0.0, dist.expected_max(max(rows, longest_of or rows)) - 1.0)
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


PAGED_SEGMENTS = 8  # a paged batch's decode steps are priced in this many stretches of equal length


@dataclass(frozen=True)
class PagedSchedule:
    """How a paged engine runs a batch (`paged_schedule`): stretches of decode steps as (steps,
    cached tokens per running row, prompt included; running rows), the decode steps in all, the
    tokens prefilled again when preempted rows come back, and how many preemptions there were."""

    segments: tuple[tuple[float, float, int], ...]
    steps: int
    recomputed_tokens: int
    preemptions: int
    row_steps: int  # tokens the decode steps made (the prefills make each row's first, and a resumed row's next)
    peak_tokens: int  # the most tokens cached at once
    peak_rows: int  # the most rows running at once


def quantile_lengths(dist: LengthDist | None, *, cap: int, rows: int, longest_of: int | None = None) -> list[int]:
    """`rows` response lengths standing for the distribution: its quantiles at (i + 1/2) / rows,
    in the order a random batch mixes them (a fixed stride of about 0.618 rows through the sorted
    quantiles, so long and short responses come spread out, as independent draws do). With
    `longest_of` the longest is the quantile at 1 - 1/(2 longest_of): the batch that drew the
    longest of that many responses (the slowest of several engines)."""
    if dist is None:
        return [cap] * rows
    qs = (np.arange(rows) + 0.5) / rows
    if longest_of is not None and longest_of > rows:
        qs[-1] = 1.0 - 0.5 / longest_of
    ranked = np.clip(np.searchsorted(np.asarray(dist.cdf), qs, side="left"), 1, cap)
    stride = max(1, round(rows * 0.6180339887))
    while np.gcd(stride, rows) != 1:
        stride += 1
    return [int(ranked[(i * stride) % rows]) for i in range(rows)]


@lru_cache(maxsize=4096)
def paged_schedule(dist: LengthDist | None, *, cap: int, rows: int, prompt: int, kv_tokens: int,
                   max_seqs: int | None, longest_of: int | None = None) -> PagedSchedule:
    """The decode steps of `rows` responses (after their prefills) on one engine whose KV cache
    holds `kv_tokens` tokens, as vLLM V1's scheduler runs them (`vllm/v1/core/sched/scheduler.py`):

    - each step, every running row takes a slot for one more token; when one does not fit, the most
      recently admitted row is preempted (its cache freed; it goes back to the head of the queue,
      its tokens so far kept) until the rest fit, and no row is admitted in that step;
    - otherwise waiting rows are admitted in order while fewer than `max_seqs` run and their
      tokens so far fit beside the running rows' (with room for the step that follows: the fluid
      stand-in for the cache's 16-token blocks); a fresh row's prefill makes its first token, a
      preempted one's prefills its prompt and every token it had made again (`recomputed_tokens`);
    - a row leaves, freeing its cache, when it has made its length.

    Lengths are the distribution's quantiles (`quantile_lengths`; all `cap` without one), the
    longest that of `longest_of` responses where the engine is the slowest of several. Steps
    are simulated from event to event (a row ending, the cache filling), so the cost is in rows,
    not in steps."""
    import heapq
    from collections import deque

    lengths = quantile_lengths(dist, cap=cap, rows=rows, longest_of=longest_of)
    limit = max_seqs or rows
    waiting: deque[tuple[int, int]] = deque((i, 0) for i in range(rows))  # (row, tokens made so far)
    running: dict[int, tuple[int, int, int]] = {}  # row -> (its cache less the step count, last step, admission)
    ends: list[tuple[int, int, int]] = []  # (last step, admission, row)
    now = base_sum = admissions = recomputed = preemptions = 0
    stretches: list[tuple[int, int, float]] = []  # (steps, running rows, mean cached tokens)
    preempted = False
    while waiting or running:
        if not preempted:
            while waiting and len(running) < limit:
                row, made = waiting[0]
                cached = prompt + made
                used = base_sum + len(running) * now
                if running and used + cached + len(running) + 1 > kv_tokens:
                    break
                waiting.popleft()
                recomputed += cached if made else 0
                made += 1  # the prefill's last position makes the next token
                if made >= lengths[row]:
                    continue
                admissions += 1
                last = now + lengths[row] - made
                running[row] = (cached - now, last, admissions)
                base_sum += cached - now
                heapq.heappush(ends, (last, admissions, row))
        r = len(running)
        used = base_sum + r * now
        if used + r > kv_tokens and r > 1:  # no room for this step: preempt the newest row
            row, (base, last, _) = running.popitem()
            base_sum -= base
            waiting.appendleft((row, lengths[row] - (last - now)))
            preemptions += 1
            preempted = True
            continue
        preempted = False
        if r == 0:
            continue
        while ends and running.get(ends[0][2], (0, -1, -1))[2] != ends[0][1]:
            heapq.heappop(ends)  # a preempted row's old end
        steps = min(ends[0][0] - now, max(1, (kv_tokens - used) // r))
        stretches.append((steps, r, used + r * (steps + 1) / 2))
        now += steps
        while ends and ends[0][0] == now:
            _, admission, row = heapq.heappop(ends)
            if running.get(row, (0, -1, -1))[2] == admission:
                base_sum -= running.pop(row)[0]
    return PagedSchedule(_paged_segments(stretches, now), now, recomputed, preemptions,
                         row_steps=sum(k * r for k, r, _ in stretches),
                         peak_tokens=int(max((u + r * (k - 1) / 2 for k, r, u in stretches), default=0)),
                         peak_rows=max((r for _, r, _ in stretches), default=0))


def _paged_segments(stretches: list[tuple[int, int, float]], total: int) -> tuple[tuple[float, float, int], ...]:
    """`PAGED_SEGMENTS` stretches of equal steps, each at its mean running rows and mean cached
    tokens per running row (so the tokens read per step keep their mean)."""
    if total == 0:
        return ()
    k = np.array([s[0] for s in stretches], dtype=np.float64)
    r = np.array([s[1] for s in stretches], dtype=np.float64)
    u = np.array([s[2] for s in stretches], dtype=np.float64)
    end = np.cumsum(k)
    start = end - k
    out = []
    edges = np.linspace(0.0, float(total), min(PAGED_SEGMENTS, total) + 1)
    for a, b in zip(edges[:-1], edges[1:]):
        w = np.clip(np.minimum(end, b) - np.maximum(start, a), 0.0, None)
        rows = float(np.sum(w * r))
        if rows == 0:
            continue
        out.append((float(b - a), float(np.sum(w * u)) / rows, max(1, int(np.ceil(rows / (b - a))))))
    return tuple(out)
