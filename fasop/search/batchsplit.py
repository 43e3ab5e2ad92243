"""The exact uneven batch split of data-parallel plans: the integer samples per GPU of each node type, summing to
the global batch, that make the slowest GPU finish first, each GPU running its samples as micro-batches of the size
that ends them soonest (docs/uneven-ddp.md).
"""

from __future__ import annotations

import math
import struct

import numpy as np

TIE_TOLERANCE = 1e-9  # relative: step times closer than this are equal when choosing a micro-batch size
SPLIT_SLACK = 2e-15  # relative: covers the rounding (a few units of 2**-53) of the lines bounding a step time (_Share)
SPLIT_BLOCK_ELEMENTS = 2**20  # step times evaluated at once (samples x micro-batch sizes): bounded memory
# Sums the exact split may try (_Sums.largest): bounds its work on clusters whose GPU counts per node type are
# large and share no divisor, where the sums close to the extremes reach only some multiples of the counts' gcd
SPLIT_STEPS = 2**20


class SplitStepLimit(Exception):
    """The exact split would need more than SPLIT_STEPS steps."""


def step_times(unit_s: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(time, micro-batch size) of one GPU for each count of samples per step in `samples`.

    unit_s[b] is the forward and backward time of one micro-batch of b samples (unit_s[0] = 0), for every
    size b that fits memory. s samples run as ceil(s / b) micro-batches of b, the last one holding the rest;
    the best b is kept, the smallest among those within TIE_TOLERANCE of it (profiles interpolate linearly, so
    sizes often tie up to rounding, and a smaller one needs less memory)."""
    sizes = np.arange(1, len(unit_s))
    s = np.asarray(samples, dtype=np.int64)[:, None]
    total = (s // sizes) * unit_s[sizes] + unit_s[s % sizes]
    best = np.argmax(total <= total.min(axis=1, keepdims=True) * (1 + TIE_TOLERANCE), axis=1)
    return total[np.arange(len(s)), best], sizes[best]


class _Share:
    """The samples per GPU s = 1 .. cap of one group that end within a makespan T: the s with f(s) <= T, f the
    time of step_times. f(s) = h_b(s) = (s // b) unit_s[b] + unit_s[s % b] for the size b it picks, and with
    r_b = unit_s[b] / b every h_b lies between two lines: r_b (s - b + 1) <= h_b(s) <= r_b s + max_{b' < b}
    unit_s[b']. The pick is within 1 + TIE_TOLERANCE of the best size, so every s left of where that factor times
    the upper line of the size with the least r_b crosses T fits, and none right of where every lower line has.
    Between, only sizes whose lower line dips under that bound can be picked: every s left of where all their
    upper lines cross T fits, none right of where all their lower lines do, and only the s between (a few
    micro-batch sizes, whatever the batch) are timed."""

    def __init__(self, unit_s: np.ndarray, cap: int):
        self.unit_s, self.cap = unit_s, cap
        sizes = np.arange(1, len(unit_s))
        rates = unit_s[1:] / sizes
        slack = SPLIT_SLACK * float(unit_s.max())  # both lines' constants are at most the largest time
        self.upper = (rates * (1 + SPLIT_SLACK), np.maximum.accumulate(unit_s[:-1]) + slack)
        self.lower = (rates * (1 - SPLIT_SLACK), -(sizes - 1) * rates - slack)
        self.best = int(np.argmin(rates))

    def _last(self, slope: float, intercept: float, limit: float) -> int:
        """The largest s in 0 .. cap at which the line is at most `limit` (0 when no s >= 1 is)."""
        x = (limit - intercept) / slope
        s = self.cap if x >= self.cap else max(0, math.floor(x))
        while s > 0 and slope * s + intercept > limit:
            s -= 1
        while s < self.cap and slope * (s + 1) + intercept <= limit:
            s += 1
        return s

    def runs(self, limit: float) -> list[tuple[int, int]]:
        """The runs (first, last) of consecutive s in 1 .. cap with f(s) <= limit, ascending."""
        if limit == math.inf:
            return [(1, self.cap)] if self.cap else []
        slope, intercept = (line[self.best] * (1 + TIE_TOLERANCE) for line in self.upper)
        sure = self._last(slope, intercept, limit)
        maybe = max(self._last(a, b, limit) for a, b in zip(*self.lower))
        if sure < maybe:
            ends = np.array([sure + 1, maybe], dtype=float)
            under = self.lower[0][:, None] * ends + self.lower[1][:, None] <= slope * ends + intercept
            picked = np.flatnonzero(under.any(axis=1))
            sure = max(sure, min(self._last(self.upper[0][b], self.upper[1][b], limit) for b in picked))
            maybe = min(maybe, max(self._last(self.lower[0][b], self.lower[1][b], limit) for b in picked))
        runs = [(1, sure)] if sure else []
        block = max(1, SPLIT_BLOCK_ELEMENTS // len(self.unit_s))
        for first in range(sure + 1, maybe + 1, block):
            s = np.arange(first, min(maybe, first + block - 1) + 1)
            for value in s[step_times(self.unit_s, s)[0] <= limit].tolist():
                if runs and runs[-1][1] == value - 1:
                    runs[-1] = (runs[-1][0], value)
                else:
                    runs.append((value, value))
        return runs


class _Sums:
    """The sums sum_t counts[t] s_t of the first i groups, each s_t in its group's runs (ascending runs of
    integers), for every i. The sums of groups 0 .. i-1 are multiples of their gcd between a least and a greatest
    sum, and every such multiple inside the zone [zl, zh] of prefix i, where it has one, is reached: prefix 1's
    zone is its count times its longest run; prefix i+1's is prefix i's plus count_i times the longest run [a, b]
    of group i, less m - 1 steps at each end (m = gcd / gcd(gcd, count_i): any m consecutive s_i meet every
    residue), kept when the run holds m values and the zone is count_i * m wide. Sums outside the zones are tried
    one by one; those fringes span a few runs of each group, whatever the batch."""

    def __init__(self, runs: list[list[tuple[int, int]]], counts: list[int], spent: list[int]):
        self.runs, self.counts, self.spent = runs, counts, spent
        self.gcd, self.least, self.most = [0], [0], [0]
        self.zone: list[tuple[int, int] | None] = [(0, 0)]
        self.memo: dict[tuple[int, int], bool] = {}
        for n, group in zip(counts, runs):
            if not group:
                break
            a, b = max(group, key=lambda run: run[1] - run[0])
            g, zone = self.gcd[-1], self.zone[-1]
            m = g // math.gcd(g, n) if g else 1
            if zone is not None and (not g or (b - a + 1 >= m and zone[1] - zone[0] >= n * m)):
                zone = (zone[0] + n * (a + m - 1), zone[1] + n * (b - m + 1))
            else:
                zone = None
            self.gcd.append(math.gcd(g, n))
            self.least.append(self.least[-1] + n * group[0][0])
            self.most.append(self.most[-1] + n * group[-1][1])
            self.zone.append(zone)

    def reaches(self, i: int, total: int) -> bool:
        """Whether groups 0 .. i-1 sum to `total`."""
        if len(self.gcd) <= i or not self.least[i] <= total <= self.most[i] or (i and total % self.gcd[i]):
            return False
        zone = self.zone[i]
        if zone is not None and zone[0] <= total <= zone[1]:
            return True
        if (i, total) not in self.memo:
            self.memo[(i, total)] = self.largest(i - 1, total) is not None
        return self.memo[(i, total)]

    def largest(self, j: int, total: int) -> int | None:
        """The largest s_j of group j's runs with which groups 0 .. j-1 can make up the rest of `total`."""
        n, g, zone = self.counts[j], self.gcd[j], self.zone[j]
        if not g:
            s = total // n
            return s if total % n == 0 and any(a <= s <= b for a, b in self.runs[j]) else None
        d = math.gcd(n, g)
        if total % d:
            return None
        m = g // d  # the rest is a multiple of g for one residue r of s modulo m
        r = total // d * pow(n // d, -1, m) % m
        zone_low, zone_high = (-(-(total - zone[1]) // n), (total - zone[0]) // n) if zone else (1, 0)
        for a, b in reversed(self.runs[j]):
            low, high = max(a, -(-(total - self.most[j]) // n)), min(b, (total - self.least[j]) // n)
            s = high - (high - r) % m
            while s >= low:
                self.spent[0] += 1
                if self.spent[0] > SPLIT_STEPS:
                    raise SplitStepLimit(f"the exact batch split over {', '.join(map(str, self.counts))} GPUs needs "
                                         f"more than {SPLIT_STEPS} steps (its limit)")
                if zone_low <= s <= zone_high or self.reaches(j, total - n * s):
                    return s
                s -= m
        return None

    def split(self, total: int) -> list[int]:
        """The s of every group summing to `total`, each group from the last taking as many as it can."""
        split = [0] * len(self.counts)
        for j in reversed(range(len(self.counts))):
            s = self.largest(j, total)
            assert s is not None  # `total` is reached
            split[j], total = s, total - self.counts[j] * s
        return split


def _float(bits: int) -> float:
    """The float of a bit pattern: non-negative floats order like their bit patterns."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def best_split(units: list[np.ndarray], counts: list[int], batch: int) -> tuple[float, list[int]] | None:
    """The exact minimum over integers s_t >= 1 with sum_t counts[t] * s_t = batch of max_t f_t(s_t), f_t the time
    of step_times(units[t]), and the s_t reaching it; None when no such s exists. Raises SplitStepLimit past
    SPLIT_STEPS sums tried.

    A makespan T is reachable when some s_t with f_t(s_t) <= T sum to the batch (_Share, _Sums); that only grows
    with T, so a bisection over the floats finds the smallest, one of the f_t(s). Among the splits of that
    makespan, later groups take as many samples as they can. The work grows with the groups, their micro-batch
    sizes and GPU counts, and only with the logarithm of the batch."""
    shares = [_Share(unit_s, batch // n) for unit_s, n in zip(units, counts)]
    spent = [0]

    def sums(limit: float) -> _Sums:
        return _Sums([share.runs(limit) for share in shares], counts, spent)

    if not sums(math.inf).reaches(len(counts), batch):
        return None
    low, high = 0, struct.unpack("<q", struct.pack("<d", math.inf))[0]  # 0.0 is too short: every f_t(s) > 0
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if sums(_float(mid)).reaches(len(counts), batch) else (mid, high)
    limit = _float(high)
    return limit, sums(limit).split(batch)
