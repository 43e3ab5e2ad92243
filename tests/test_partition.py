"""The exact partitioner against brute force over every partition, and against FASOP's greedy heuristic."""

import itertools
from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fasop.cost.problem import PartitionBatch
from fasop.search.partition import _caps, _clipped_hi, _Filler, _smallest_feasible, optimal_partitions


def compositions(total: int, parts: int, lo: list[int]):
    """Every vector of `parts` integers >= lo summing to total."""
    if parts == 1:
        if total >= lo[0]:
            yield (total,)
        return
    for first in range(lo[0], total - sum(lo[1:]) + 1):
        for rest in compositions(total - first, parts - 1, lo[1:]):
            yield (first,) + rest


def row_problem(batch: PartitionBatch, row: int) -> PartitionBatch:
    return batch.take(np.array([row]))


def brute_force(batch: PartitionBatch, row: int):
    """The smallest objective over every feasible partition of problem `row` (None if none fits)."""
    one = row_problem(batch, row)
    seg = batch.segment_of_stage
    per_segment = []
    for s, layers in enumerate(batch.segment_layers):
        stages = np.flatnonzero(seg == s)
        per_segment.append(list(compositions(int(layers), len(stages), [int(one.lo[0, i]) for i in stages])))
    best = None
    for combo in itertools.product(*per_segment):
        counts = np.concatenate(combo)[None, :]
        if not one.feasible(counts)[0]:
            continue
        value = float(one.objective(counts)[0])
        best = value if best is None else min(best, value)
    return best


def greedy_minmax(layer_s, fixed_s, exchange_s, lo, total):
    """FASOP's partitioner (reference section 3.5): start even, move one layer from the slowest stage to the
    fastest while the maximum stage time improves. Used here only as a baseline."""
    p = len(layer_s)
    counts = np.full(p, total // p)
    counts[: total - counts.sum()] += 1
    counts = np.maximum(counts, lo)
    while counts.sum() > total:
        counts[np.argmax(counts - lo)] -= 1
    best = None
    for _ in range(10 * total):
        times = fixed_s + layer_s * counts + exchange_s
        worst, fastest = int(np.argmax(times)), int(np.argmin(times))
        if best is not None and times.max() >= best:
            break
        best = times.max()
        if counts[worst] <= lo[worst] or worst == fastest:
            break
        trial = counts.copy()
        trial[worst] -= 1
        trial[fastest] += 1
        if (fixed_s + layer_s * trial + exchange_s).max() >= times.max():
            break
        counts = trial
    return counts


def _segments(draw, stages: int, encoder_decoder: bool, spare: int, most: int):
    """(segment of each stage, layers per segment, fewest layers per stage): an encoder-decoder split with up
    to `spare` layers more than stages per segment, or one decoder segment of up to `most` layers whose first
    and last stages may hold only the embedding and the head."""
    if encoder_decoder:
        split = draw(st.integers(1, stages - 1))
        segment = np.array([0] * split + [1] * (stages - split))
        layers = np.array([draw(st.integers(split, split + spare)),
                           draw(st.integers(stages - split, stages - split + spare))])
        return segment, layers, np.ones(stages, dtype=int)
    lo = np.ones(stages, dtype=int)
    lo[0] = lo[-1] = 0
    return np.zeros(stages, dtype=int), np.array([draw(st.integers(max(stages - 2, 1), most))]), lo


@st.composite
def problems(draw, two_segments=True, roomy=False):
    """Random problems of up to 5 stages; decoder-only when not two_segments; with roomy, every stage's memory
    holds every layer (hi >= the layers), so that any split with the right sum and the lower bounds fits."""
    stages = draw(st.integers(1, 5))
    encoder_decoder = two_segments and stages >= 2 and draw(st.booleans())
    segment, layers, lo = _segments(draw, stages, encoder_decoder, spare=5, most=10)
    batch = draw(st.integers(1, 3))
    floats = st.floats(0.1, 5.0)

    def vec(strategy=floats):
        return np.array([[draw(strategy) for _ in range(stages)] for _ in range(batch)])

    hi = np.array([[draw(st.integers(int(layers.sum()) if roomy else 0, 12)) for _ in range(stages)]
                   for _ in range(batch)])
    ar_layer = vec(st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.5]))
    return PartitionBatch(
        segment_of_stage=segment, segment_layers=layers, lo=np.broadcast_to(lo, (batch, stages)), hi=hi,
        layer_s=vec(), period_fixed_s=vec(st.floats(0.0, 3.0)), ar_fixed_s=vec(st.floats(0.0, 2.0)),
        ar_layer_s=ar_layer, num_microbatches=np.array([draw(st.integers(1, 9)) for _ in range(batch)]),
        base_s=np.array([draw(st.floats(0.0, 2.0)) for _ in range(batch)]),
    )


@settings(max_examples=400, deadline=None)
@given(problems())
def test_optimal_partition_equals_brute_force(batch):
    counts, value, feasible = optimal_partitions(batch)
    for row in range(len(batch)):
        expected = brute_force(batch, row)
        assert feasible[row] == (expected is not None)
        if expected is None:
            continue
        one = row_problem(batch, row)
        assert one.feasible(counts[row:row + 1])[0]
        assert np.isclose(value[row], expected, rtol=1e-9, atol=1e-12)
        assert np.isclose(one.objective(counts[row:row + 1])[0], value[row], rtol=1e-12)


@settings(max_examples=200, deadline=None)
@given(problems(two_segments=False, roomy=True))
def test_never_worse_than_greedy(batch):
    """On decoder-only problems whose stages hold every layer, the greedy split is always a valid one: the
    exact partition's step time is never above it."""
    counts, value, feasible = optimal_partitions(batch)
    total = int(batch.segment_layers[0])
    for row in range(len(batch)):
        greedy = greedy_minmax(batch.layer_s[row], batch.period_fixed_s[row], 0 * batch.layer_s[row], batch.lo[row], total)
        one = row_problem(batch, row)
        assert feasible[row] and one.feasible(greedy[None, :])[0]
        assert value[row] <= float(one.objective(greedy[None, :])[0]) + 1e-12


def test_greedy_stops_where_the_exact_partition_goes_on():
    """4 layers of 3, 2 and 3 s on stages with 1, 0 and 4 s fixed, 2 micro-batches. Greedy starts at 2, 1, 1
    (periods 7, 2, 7); moving a layer from the first stage to the second gives 4, 4, 7, no lower maximum, so
    it stops: 11 s of layers + 7 = 18 s. The exact split 1, 3, 0 has periods 4, 6, 4: 9 + 6 = 15 s."""
    layer_s, fixed_s, lo = np.array([3.0, 2.0, 3.0]), np.array([1.0, 0.0, 4.0]), np.array([0, 1, 0])
    batch = PartitionBatch(segment_of_stage=np.zeros(3, dtype=int), segment_layers=np.array([4]), lo=lo[None, :],
                           hi=np.full((1, 3), 4), layer_s=layer_s[None, :], period_fixed_s=fixed_s[None, :],
                           ar_fixed_s=np.zeros((1, 3)), ar_layer_s=np.zeros((1, 3)), num_microbatches=np.array([2]),
                           base_s=np.array([0.0]))
    greedy = greedy_minmax(layer_s, fixed_s, np.zeros(3), lo, 4)
    assert greedy.tolist() == [2, 1, 1] and batch.objective(greedy[None, :])[0] == 18
    counts, value, feasible = optimal_partitions(batch)
    assert feasible[0] and counts[0].tolist() == [1, 3, 0] and value[0] == 15


def every_partition(batch: PartitionBatch) -> np.ndarray:
    """(C, P): every vector of non-negative counts with the right layer sum in each segment."""
    per_segment = []
    for s, layers in enumerate(batch.segment_layers):
        stages = int((batch.segment_of_stage == s).sum())
        per_segment.append(list(compositions(int(layers), stages, [0] * stages)))
    return np.array([np.concatenate(combo) for combo in itertools.product(*per_segment)])


def near_ties(draw, palette, shape):
    """Values from a small palette, some moved by 1e-10 relative: ties and near-ties between stages."""
    size = int(np.prod(shape))
    base = np.array([draw(st.sampled_from(palette)) for _ in range(size)])
    nudge = np.array([draw(st.sampled_from([-1, 0, 0, 1])) for _ in range(size)])
    return (base * (1 + nudge * 1e-10)).reshape(shape)


@st.composite
def tied_problems(draw):
    """Up to 8 stages, decoder or encoder-decoder segments, per-layer costs small against fixed ones (so that
    near-equal stage periods differ by less than a layer's share of a relative tolerance)."""
    stages = draw(st.integers(1, 8))
    encoder_decoder = stages >= 2 and draw(st.booleans())
    segment, layers, lo = _segments(draw, stages, encoder_decoder, spare=3, most=stages + 4)
    batch = draw(st.integers(1, 3))
    shape = (batch, stages)
    hi = np.array([[draw(st.integers(0, 12)) for _ in range(stages)] for _ in range(batch)])
    return PartitionBatch(
        segment_of_stage=segment, segment_layers=layers, lo=np.broadcast_to(lo, shape), hi=hi,
        layer_s=near_ties(draw, [0.01, 1 / 3], shape),
        period_fixed_s=near_ties(draw, [0.0, 7.0, 1e3], shape),
        ar_fixed_s=near_ties(draw, [0.0, 20.0], shape), ar_layer_s=near_ties(draw, [0.0, 0.001, 1.0], shape),
        num_microbatches=np.array([draw(st.sampled_from([1, 2, 3, 8, 1000])) for _ in range(batch)]),
        base_s=np.array([draw(st.sampled_from([0.0, 1.0])) for _ in range(batch)]),
    )


@settings(max_examples=500, deadline=None)
@given(tied_problems())
def test_ties_and_near_ties_keep_every_layer_and_the_optimum(batch):
    counts, value, feasible = optimal_partitions(batch)
    candidates = every_partition(batch)
    for row in range(len(batch)):
        one = row_problem(batch, row)
        fits = one.feasible(candidates)
        assert feasible[row] == fits.any()
        if not fits.any():
            continue
        assert one.feasible(counts[row:row + 1])[0]  # every layer held, each stage within its bounds
        assert value[row] == one.objective(counts[row:row + 1])[0]
        assert value[row] <= one.objective(candidates[fits]).min() * (1 + 1e-12)


@st.composite
def heavier(draw, batch: PartitionBatch) -> PartitionBatch:
    """The same problems with recomputation's effect: more compute per layer and per stage, other memory caps."""
    shape = batch.lo.shape
    extra = np.array([[draw(st.sampled_from([0.0, 0.1, 0.7])) for _ in range(shape[1])] for _ in range(shape[0])])
    hi = batch.hi + np.array([[draw(st.integers(-2, 4)) for _ in range(shape[1])] for _ in range(shape[0])])
    return replace(batch, hi=np.maximum(hi, 0), layer_s=batch.layer_s + extra,
                   period_fixed_s=batch.period_fixed_s + extra / 2, base_s=batch.base_s + extra.sum(-1))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_dominating_problem_is_never_worse(data):
    """PartitionBatch.dominates (the search's skip of heavier recompute modes) against brute force."""
    light = data.draw(problems())
    heavy = data.draw(heavier(light))
    dominates = light.dominates(heavy)
    for row in range(len(light)):
        best_light, best_heavy = brute_force(light, row), brute_force(heavy, row)
        if dominates[row] and best_heavy is not None:
            assert best_light is not None and best_light <= best_heavy * (1 + 1e-12)
        if not light.memory_binds()[row]:  # caps that never bind: the lighter problem dominates
            assert dominates[row]


def greedy_fill(batch: PartitionBatch, row: int, caps: np.ndarray) -> tuple[np.ndarray, bool]:
    """The fill by hand: in each segment, stages by cost per layer (ties: earlier first) take what their cap
    allows beyond their minimum until the segment holds its layers."""
    lo, cost = batch.lo[row], batch.layer_s[row]
    counts, ok = lo.astype(float), bool((caps >= lo).all())
    for s, layers in enumerate(batch.segment_layers):
        stages = sorted(np.flatnonzero(batch.segment_of_stage == s), key=lambda i: (cost[i], i))
        need = int(layers) - int(lo[stages].sum())
        for i in stages:
            take = min(max(caps[i] - lo[i], 0), need)
            counts[i] += take
            need -= take
        ok &= need == 0
    return counts, ok


@settings(max_examples=300, deadline=None)
@given(st.one_of(problems(), tied_problems()), st.data())
def test_fill_takes_the_cheapest_layers_under_the_caps(batch, data):
    b, p = batch.lo.shape
    vectors = data.draw(st.integers(1, 3))
    caps = np.array(data.draw(st.lists(st.integers(-1, 14), min_size=b * vectors * p, max_size=b * vectors * p)),
                    dtype=float).reshape(b, vectors, p)
    counts, ok = _Filler(batch).fill(caps)
    for row in range(b):
        for v in range(vectors):
            expected, fits = greedy_fill(batch, row, caps[row, v])
            assert ok[row, v] == fits
            if fits:
                assert counts[row, v].tolist() == expected.tolist()


@settings(max_examples=300, deadline=None)
@given(st.one_of(problems(), tied_problems()))
def test_smallest_feasible_threshold_is_the_first_value_whose_caps_admit_a_partition(batch):
    """The threshold search starts from the smallest period (and all-reduce) value whose caps admit a
    partition: against a scan of every value fixed_i + per_layer_i n in ascending order."""
    hi = _clipped_hi(batch)
    fits = _Filler(batch).fill(hi[:, None, :])[1][:, 0] & (hi >= batch.lo).all(-1)
    for row in np.flatnonzero(fits):
        one, one_hi = row_problem(batch, row), hi[row:row + 1]
        for fixed, per_layer in ((one.period_fixed_s, one.layer_s), (one.ar_fixed_s, one.ar_layer_s)):
            values = sorted({fixed[0, i] + per_layer[0, i] * n for i in range(one.lo.shape[1])
                             for n in range(int(one.lo[0, i]), int(one_hi[0, i]) + 1)})
            admitted = (v for v in values
                        if _Filler(one).fill(_caps(np.array([[v]]), fixed, per_layer, one_hi))[1][0, 0])
            assert _smallest_feasible(fixed, per_layer, one, one_hi)[0] == next(admitted)


@settings(max_examples=300, deadline=None)
@given(st.one_of(problems(), tied_problems()), st.data())
def test_caps_are_the_most_layers_whose_value_stays_within_the_threshold(batch, data):
    """_caps against a scan of every count 0..hi, thresholds taken among the values themselves (where the rounded
    quotient is most often one off), just beside them, and infinite."""
    hi = _clipped_hi(batch)
    fixed, per_layer = batch.period_fixed_s, batch.layer_s
    values = [fixed[b, i] + per_layer[b, i] * n for b in range(len(batch)) for i in range(hi.shape[1])
              for n in range(int(hi[b, i]) + 1)]
    pick = st.sampled_from(values) if values else st.just(1.0)
    thresholds = np.array([[data.draw(st.one_of(pick, pick.map(lambda x: x * (1 + 1e-12)), st.just(np.inf)))
                            for _ in range(3)] for _ in range(len(batch))])
    caps = _caps(thresholds, fixed, per_layer, hi)
    for b in range(len(batch)):
        for k, x in enumerate(thresholds[b]):
            for i in range(hi.shape[1]):
                within = [n for n in range(int(hi[b, i]) + 1) if fixed[b, i] + per_layer[b, i] * n <= x]
                assert caps[b, k, i] == (max(within) if within else -1)
