"""The exact layer partition: how many transformer layers each pipeline stage gets.

Every layer of a segment (the decoder-only stack, or the encoder and the decoder of an encoder-decoder model)
costs the same on a given stage, so a partition is a vector of layer counts n, and every per-stage quantity
is affine in n_i. The step time of docs/cost-model.md is

    F(n) = base + sum_i layer_s[i] n_i + (m - 1) max_i period_i(n_i) + max_i allreduce_i(n_i)

with period_i = period_fixed_s[i] + layer_s[i] n_i and allreduce_i = ar_fixed_s[i] + ar_layer_s[i] n_i,
subject to lo_i <= n_i <= hi_i (hi from memory) and the layers of each segment summing to its count.

Under thresholds X >= max period and Y >= max all-reduce each stage may hold at most cap_i(X, Y) layers,
and the cheapest layer sum under those caps is a greedy fill (the stages with the cheapest layers first).
So F* = min over (X, Y) of base + fill(X, Y) + (m - 1) X + Y, where X and Y range over the values periods
and all-reduces can take: the optimal partition's own maxima are among them, and no pair can undercut it.
A known solution bounds how far above their smallest feasible values X and Y can usefully go, which keeps
the grid small. Everything runs on a batch of problems of the same shape at once; tests compare the result
with brute force over every partition.
"""

from __future__ import annotations

import numpy as np

from fasop.cost.problem import PartitionBatch, segment_sums

_EPS = 1e-9
_GRID_ELEMENTS = 4_000_000  # grid cells (problems x X x Y x stages) evaluated at once
_VALUE_ELEMENTS = 16_000_000  # stage values (problems x stages x layer counts) held at once
# Multiply-adds per problem up to which the fill's products go to BLAS, which runs products this small on the calling
# thread (OpenBLAS's threshold); larger ones run in numpy's own loop, since BLAS threads cost more than they save on
# them, and far more when other processes hold the cores.
_BLAS_PRODUCT = 2**18


class _Filler:
    """Cheapest placement of each segment's layers under per-stage caps, for many cap vectors at once.

    Within a segment the stages take layers cheapest first (ties: earlier stage first), each as many as its cap
    allows until the segment has its layers: a stage takes what its segment still needs once the stages before it
    have taken all their room. Counts are whole numbers, so every sum of room is exact in any order (caps must be
    finite)."""

    def __init__(self, batch: PartitionBatch):
        self.lo, self.layer_s = batch.lo, batch.layer_s
        b, p = batch.lo.shape
        self.segment = np.broadcast_to(batch.segment_of_stage, (b, p))
        stage = np.broadcast_to(np.arange(p), (b, p))
        # the stages in filling order (segment by segment), each one's place in it, and where its segment starts
        self.order = np.lexsort((stage, batch.layer_s, self.segment), axis=-1)
        self.place = np.argsort(self.order, axis=-1)
        ordered_segment = np.take_along_axis(self.segment, self.order, axis=-1)
        starts = np.ones((b, p), dtype=bool)
        starts[:, 1:] = ordered_segment[:, 1:] != ordered_segment[:, :-1]
        self.segment_start = np.maximum.accumulate(np.where(starts, stage, 0), axis=-1)
        # (b, segments) the stage of each segment that fills last
        segments = np.arange(len(batch.segment_layers))
        ends = (ordered_segment[:, :, None] <= segments).sum(axis=1) - 1
        self.segment_last = np.take_along_axis(self.order, ends, axis=-1)
        self.remaining = batch.segment_layers[None, :] - segment_sums(batch.lo, self.segment, len(batch.segment_layers))
        self.stage_needs = np.take_along_axis(self.remaining, self.segment, axis=-1)  # what the stage's segment needs

    def _room_before(self, room: np.ndarray, cells: np.ndarray, index) -> np.ndarray:
        """(B', ..., P) room of the stages that fill before each stage in its segment (`cells`: the room as (B', cap
        vectors, P)). With at least as many cap vectors per problem as stages, a product with each problem's 0/1
        matrix of who fills before whom (no larger than the product itself); else a running sum along the stages in
        filling order."""
        if cells.shape[1] >= cells.shape[2]:
            cost, segment, stage = self.layer_s[index], self.segment[index], np.arange(cells.shape[2])
            first = (cost[:, :, None] < cost[:, None, :]) | (cost[:, :, None] == cost[:, None, :]) & (stage[:, None] < stage)
            first &= segment[:, :, None] == segment[:, None, :]
            if cells.shape[1] * cells.shape[2] ** 2 <= _BLAS_PRODUCT:
                return np.matmul(cells, first.astype(float)).reshape(room.shape)
            return np.einsum("bvp,bpq->bvq", cells, first.astype(float)).reshape(room.shape)
        expand = (slice(None),) + (None,) * (room.ndim - 2)
        order, place, start = (np.broadcast_to(a[index][expand], room.shape)
                               for a in (self.order, self.place, self.segment_start))
        ordered = np.take_along_axis(room, order, axis=-1)
        before = np.cumsum(ordered, axis=-1) - ordered
        before -= np.take_along_axis(before, start, axis=-1)  # counted from the start of the stage's segment
        return np.take_along_axis(before, place, axis=-1)

    def fill(self, caps: np.ndarray, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """caps (B', ..., P) for the problems `rows` (default all) -> (counts, feasible (B', ...))."""
        index: slice | np.ndarray = slice(None) if rows is None else rows
        expand = (slice(None),) + (None,) * (caps.ndim - 2)
        lo = self.lo[index][expand]
        room = np.clip(caps - lo, 0, None)
        cells = room.reshape(len(room), room.size // max(room.shape[0] * room.shape[-1], 1), room.shape[-1])
        before = self._room_before(room, cells, index)
        taken = np.clip(self.stage_needs[index][expand] - before, 0, room)
        last = self.segment_last[index][expand]
        # a segment's room: what its stages before the last leave, and the last's
        segment_room = np.take_along_axis(before + room, np.broadcast_to(last, room.shape[:-1] + last.shape[-1:]), axis=-1)
        ok = (caps >= lo).all(axis=-1) & (segment_room >= self.remaining[index][expand]).all(axis=-1)
        return taken + lo, np.asarray(ok)


def _caps(threshold: np.ndarray, fixed: np.ndarray, per_layer: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Most layers per stage (at most hi, -1 for none) whose value fixed + per_layer * n is <= threshold;
    threshold (B, K) -> caps (B, K, P).

    Values are compared exactly as `_values` and `PartitionBatch.objective` compute them, so a threshold
    taken from `_values` admits every count whose value it is: a tolerance here would either admit a count
    whose value exceeds the threshold or refuse the count that defines it."""
    x, f, r, top = threshold[:, :, None], fixed[:, None, :], per_layer[:, None, :], hi[:, None, :]
    positive = r > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.floor((x - f) / r)
    caps = np.clip(np.where(positive, guess, np.where(f <= x, top, -1)), -1, top)
    # the rounded quotient can be one off either way: settle it on the values themselves, in two passes; a pass
    # repeats itself on a count it left unmoved, so the second visits only the counts the first moved
    settled = _settle(caps, x, f, r, top, positive)
    moved = np.nonzero(settled != caps)
    if len(moved[0]):
        settled[moved] = _settle(settled[moved], *(np.broadcast_to(a, caps.shape)[moved] for a in (x, f, r, top, positive)))
    return settled


def _settle(caps, x, f, r, top, positive):
    """One pass of `_caps`' correction: up one where the next count's value is still <= x, down one where the
    count's own value exceeds x."""
    caps = caps + (positive & (caps + 1 <= top) & (f + r * (caps + 1) <= x))
    return caps - (positive & (caps >= 0) & (f + r * caps > x))


def _values(fixed: np.ndarray, per_layer: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """(B, V): the distinct values fixed_i + per_layer_i n takes for lo_i <= n <= hi_i, ascending, +inf padded.

    Only exact repeats are merged: the optimum's own maxima must stay candidates, however close another
    value comes."""
    values = _stage_values(fixed, per_layer, lo, hi, 0, max(int((hi - lo).max()) + 1, 1))
    values = np.sort(values.reshape(len(lo), -1), axis=-1)
    repeat = np.zeros(values.shape, dtype=bool)
    repeat[:, 1:] = values[:, 1:] == values[:, :-1]
    return _compact(values, ~repeat)


def _stage_values(fixed: np.ndarray, per_layer: np.ndarray, lo: np.ndarray, hi: np.ndarray, first: int,
                  span: int) -> np.ndarray:
    """(B, P, span): fixed_i + per_layer_i n for n = lo_i + first, lo_i + first + 1, ..., +inf beyond hi_i."""
    n = lo[:, :, None] + np.arange(first, first + span, dtype=float)
    values = fixed[:, :, None] + per_layer[:, :, None] * n
    values[n > hi[:, :, None]] = np.inf
    return values


def _compact(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Keep the marked entries of each row, ascending, +inf padded to the longest row."""
    kept = np.sort(np.where(keep, values, np.inf), axis=-1)
    width = max(int(np.isfinite(kept).sum(-1).max()), 1)
    return kept[:, :width]


def _smallest_feasible(fixed: np.ndarray, per_layer: np.ndarray, p: PartitionBatch, hi: np.ndarray) -> np.ndarray:
    """(B,) the smallest value fixed_i + per_layer_i n (lo_i <= n <= hi_i) whose caps (`_caps`) admit a partition of
    each problem, for problems that have one.

    The caps admit a partition when every stage reaches its fewest layers (fixed_i + per_layer_i lo_i <= X) and
    each segment has room for the layers it holds beyond those minima; the room a threshold X gives a stage is the
    number of its further counts lo_i < n <= hi_i whose value is <= X, so a segment that needs k more layers needs
    X to reach the k-th smallest value of its stages' further counts. Values are computed as `_values` computes
    them, so the answer is the threshold a search over `_values` would find."""
    seg = np.broadcast_to(p.segment_of_stage, p.lo.shape)
    need = p.segment_layers[None, :] - segment_sums(p.lo, seg, len(p.segment_layers))
    smallest = (fixed + per_layer * p.lo).max(-1)
    further = _stage_values(fixed, per_layer, p.lo, hi, 1, max(int((hi - p.lo).max()), 0) + 1)  # never empty
    rows = np.arange(len(p))
    for s in range(len(p.segment_layers)):
        mine = np.sort(np.where((seg == s)[:, :, None], further, np.inf).reshape(len(p), -1), axis=-1)
        kth = mine[rows, np.clip(need[:, s] - 1, 0, mine.shape[1] - 1)]
        smallest = np.where(need[:, s] > 0, np.maximum(smallest, kth), smallest)
    return smallest


def _clipped_hi(p: PartitionBatch) -> np.ndarray:
    """No stage can take more layers than its segment leaves it after the other stages' minimum."""
    return np.minimum(p.hi, p.most_layers).astype(float)


def admits(batch: PartitionBatch, caps: np.ndarray) -> np.ndarray:
    """(B,): whether each problem has a partition with at most caps (B, P) layers per stage."""
    return _Filler(batch).fill(caps[:, None, :])[1][:, 0]


def least_admitting(fixed: np.ndarray, per_layer: np.ndarray, batch: PartitionBatch) -> np.ndarray:
    """(B,) the least X at which the caps {n : fixed_i + per_layer_i n <= X} (per_layer >= 0) admit a partition of
    each problem, its own caps `hi` aside; inf where no partition exists at all (its stages' fewest layers exceed
    the model's). With the factor on the GPUs' memory at which a stage of n layers fits as the values: the least
    growth of memory at which some partition fits."""
    most = batch.most_layers.astype(float)
    least = np.full(len(batch), np.inf)
    for rows in _value_chunks(np.flatnonzero(admits(batch, most)), batch.lo, most):
        least[rows] = _smallest_feasible(fixed[rows], per_layer[rows], batch.take(rows), most[rows])
    return least


def lower_bounds(batch: PartitionBatch) -> np.ndarray:
    """(B,) a bound no partition of each problem can beat under the exact schedule (inf when none fits), for
    pruning searches.

    The first micro-batch passes every stage and boundary forward and back (the cheapest layer sum any partition
    can have, plus the fixed computes and sends: `base_s`), and the busiest stage works its m periods one after
    another: m times the larger of the smallest slowest-stage period any partition can have (the smallest period
    value whose caps admit a partition) and the average period; what follows the pipeline can be hidden
    entirely, so it adds nothing."""
    p = batch
    hi = _clipped_hi(p)
    filler = _Filler(p)
    widest, feasible = filler.fill(hi[:, None, :])
    widest, feasible = widest[:, 0], feasible[:, 0] & (hi >= p.lo).all(-1)
    layer_sum = (p.layer_s * widest).sum(-1)
    smallest = np.zeros(len(p))  # rows without a partition are given inf below
    for rows in _value_chunks(np.flatnonzero(feasible), p.lo, hi):
        q, q_hi = p.take(rows), hi[rows]
        smallest[rows] = _smallest_feasible(q.period_fixed_s, q.layer_s, q, q_hi)
    stages = p.lo.shape[1]
    period = np.maximum(smallest, (p.period_fixed_s.sum(-1) + layer_sum) / stages)
    bound = np.maximum(p.base_s + layer_sum, p.num_microbatches * period)
    return np.where(feasible, bound, np.inf)


def optimal_partitions(batch: PartitionBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts (B, P), step time (B,), feasible (B,)): the optimal layer counts of every problem."""
    p = batch
    hi = _clipped_hi(p)
    widest, feasible = _Filler(p).fill(hi[:, None, :])
    widest, feasible = widest[:, 0], feasible[:, 0] & (hi >= p.lo).all(-1)
    counts = np.where(feasible[:, None], widest, p.lo).astype(float)
    value = np.full(len(p), np.inf)
    for rows in _value_chunks(np.flatnonzero(feasible), p.lo, hi):
        counts[rows], value[rows] = _Search(p.take(rows), hi[rows], widest[rows]).run()
    return np.rint(counts).astype(int), value, feasible


def _value_chunks(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """`rows` in groups whose stage values (_values: rows x stages x layer counts) stay within _VALUE_ELEMENTS,
    so that a model of many layers on many stages takes memory for a group, not for every problem at once."""
    if not len(rows):
        return
    per_row = lo.shape[1] * (max(int((hi[rows] - lo[rows]).max()), 0) + 1)
    step = max(1, _VALUE_ELEMENTS // per_row)
    for start in range(0, len(rows), step):
        yield rows[start:start + step]


class _Search:
    """The threshold search of the module docstring for feasible problems."""

    def __init__(self, p: PartitionBatch, hi: np.ndarray, widest: np.ndarray):
        self.p, self.hi, self.filler = p, hi, _Filler(p)
        self.m1 = p.num_microbatches - 1
        self.widest = widest
        self.sum_lb = (p.layer_s * widest).sum(-1)  # the cheapest layer sum any partition can have

    def caps_x(self, x: np.ndarray, rows=slice(None)) -> np.ndarray:
        return _caps(x, self.p.period_fixed_s[rows], self.p.layer_s[rows], self.hi[rows])

    def caps_y(self, y: np.ndarray, rows=slice(None)) -> np.ndarray:
        return _caps(y, self.p.ar_fixed_s[rows], self.p.ar_layer_s[rows], self.hi[rows])

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        p, m1 = self.p, self.m1
        xs = _values(p.period_fixed_s, p.layer_s, p.lo, self.hi)
        xs[m1 == 0] = np.inf  # one micro-batch: the period does not count, nothing caps the layers
        ys = _values(p.ar_fixed_s, p.ar_layer_s, p.lo, self.hi)
        x_min = np.where(m1 == 0, np.inf, _smallest_feasible(p.period_fixed_s, p.layer_s, p, self.hi))
        y_min = _smallest_feasible(p.ar_fixed_s, p.ar_layer_s, p, self.hi)
        # a first solution: the widest fill (feasible), or one from either smallest threshold alone when it fits
        best, best_counts = p.objective(self.widest), self.widest.copy()
        for caps in (self.caps_x(x_min[:, None]), self.caps_y(y_min[:, None])):
            counts, ok = self.filler.fill(caps)
            value = np.where(ok[:, 0], p.objective(counts[:, 0]), np.inf)
            better = value < best
            best, best_counts = np.where(better, value, best), np.where(better[:, None], counts[:, 0], best_counts)
        # how far above their smallest values the thresholds can rise and still beat it
        slack = _EPS * (1 + np.abs(best))
        budget = best - p.base_s - self.sum_lb + slack
        x_cost = m1 * np.where(m1 > 0, x_min, 0.0)  # (m - 1) X at its smallest; nothing with one micro-batch
        x_bound = np.where(m1 > 0, x_min + (budget - x_cost - y_min) / np.maximum(m1, 1), np.inf)
        y_bound = budget - x_cost
        xs = _compact(xs, (xs >= x_min[:, None]) & (xs <= x_bound[:, None]) | (m1[:, None] == 0) & (xs == x_min[:, None]))
        ys = _compact(ys, (ys >= y_min[:, None]) & (ys <= y_bound[:, None]))
        nx, ny = np.maximum(np.isfinite(xs).sum(-1), 1), np.maximum(np.isfinite(ys).sum(-1), 1)
        wide = np.flatnonzero(nx * ny > 2 * (nx + ny))
        if len(wide):
            xs, ys = self.screen(wide, xs, ys, x_min, y_min, x_bound, y_bound, x_cost, best + slack)
            nx, ny = np.maximum(np.isfinite(xs).sum(-1), 1), np.maximum(np.isfinite(ys).sum(-1), 1)
        for chunk in _chunks(nx, ny, p.lo.shape[1]):
            kx, ky = int(nx[chunk].max()), int(ny[chunk].max())
            x_vals, y_vals = xs[chunk, :kx], ys[chunk, :ky]
            grid = np.minimum(self.caps_x(x_vals, chunk)[:, :, None, :], self.caps_y(y_vals, chunk)[:, None, :, :])
            grid_counts, grid_ok = self.filler.fill(grid, chunk)
            x_term = np.where(m1[chunk, None] > 0, m1[chunk, None] * np.where(np.isfinite(x_vals), x_vals, 0.0), 0.0)
            # a plain product and sum along the stages: a row's scores do not depend on the chunk's shape
            score = p.base_s[chunk, None, None] + (grid_counts * p.layer_s[chunk, None, None, :]).sum(-1)
            score = score + x_term[:, :, None] + y_vals[:, None, :]
            x_real = np.isfinite(x_vals) | (m1[chunk, None] == 0)
            score = np.where(grid_ok & x_real[:, :, None] & np.isfinite(y_vals)[:, None, :], score, np.inf)
            flat = score.reshape(len(chunk), -1).argmin(-1)
            found = np.isfinite(score.reshape(len(chunk), -1)[np.arange(len(chunk)), flat])
            pick = grid_counts.reshape(len(chunk), -1, p.lo.shape[1])[np.arange(len(chunk)), flat]
            pick_value = p.take(chunk).objective(pick)
            better = found & (pick_value < best[chunk])
            best[chunk] = np.where(better, pick_value, best[chunk])
            best_counts[chunk] = np.where(better[:, None], pick, best_counts[chunk])
        return best_counts, best

    def screen(self, rows, xs, ys, x_min, y_min, x_bound, y_bound, x_cost, limit):
        """Drop thresholds that cannot win even with the other threshold at its bound (for `rows`)."""
        p = self.p
        x_vals, y_vals = xs[rows], ys[rows]
        y_top = self.caps_y(y_bound[rows][:, None], rows)
        x_top = self.caps_x(x_bound[rows][:, None], rows)
        fill_x, ok_x = self.filler.fill(np.minimum(self.caps_x(x_vals, rows), y_top), rows)
        fill_y, ok_y = self.filler.fill(np.minimum(self.caps_y(y_vals, rows), x_top), rows)
        m1 = self.m1[rows, None]
        x_term = np.where(m1 > 0, m1 * np.where(np.isfinite(x_vals), x_vals, 0.0), 0.0)
        layer_s = p.layer_s[rows][:, None, :]
        x_lb = p.base_s[rows, None] + (fill_x * layer_s).sum(-1) + x_term + y_min[rows, None]
        y_lb = p.base_s[rows, None] + (fill_y * layer_s).sum(-1) + x_cost[rows, None] + y_vals
        keep_x = ok_x & (x_lb < limit[rows, None]) & (np.isfinite(x_vals) | (m1 == 0))
        keep_y = ok_y & (y_lb < limit[rows, None]) & np.isfinite(y_vals)
        xs, ys = xs.copy(), ys.copy()
        xs[rows] = np.sort(np.where(keep_x, x_vals, np.inf), axis=-1)
        ys[rows] = np.sort(np.where(keep_y, y_vals, np.inf), axis=-1)
        return xs, ys


def _chunks(nx: np.ndarray, ny: np.ndarray, stages: int):
    """Groups of problems with grids of similar shape (padding wastes at most 4x) within the element budget."""
    shape = np.stack([np.ceil(np.log2(nx)), np.ceil(np.log2(ny))], axis=-1).astype(int)
    for key in np.unique(shape, axis=0):
        rows = np.flatnonzero((shape == key).all(-1))
        per_problem = int(nx[rows].max() * ny[rows].max() * stages)
        step = max(1, _GRID_ELEMENTS // per_problem)
        for start in range(0, len(rows), step):
            yield rows[start:start + step]
