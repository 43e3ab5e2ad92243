"""The exact 1F1B schedule (fasop/schedule.py) against the event simulations, the closed form and hand-worked
tables, and its Gantt chart (fasop/timeline.py)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pipelines import closed_form
from simulate import simulate_1f1b, simulate_interleaved_1f1b

import fasop.cost.schedule as schedule
from fasop.cost.schedule import interleaving_error, makespan_s, op_times, stage_program
from fasop.errors import InputError
from fasop.timeline import plot_timeline, write_trace

seconds = st.floats(1.0, 3.0)  # stage times spread 3x
sends = st.one_of(st.just(0.0), st.floats(0.0, 1.0))


STAGES = st.integers(1, 8)


@st.composite
def stage_sets(draw, stages=STAGES):
    p = draw(stages)
    forward = draw(st.lists(seconds, min_size=p, max_size=p))
    backward = draw(st.lists(seconds, min_size=p, max_size=p))
    send = draw(st.lists(sends, min_size=p - 1, max_size=p - 1))
    return forward, backward, send


# -- plain 1F1B ------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(stage_sets(), st.integers(1, 16))
def test_exact_1f1b_equals_the_event_simulation(stages, m):
    forward, backward, send = stages
    exact = makespan_s([forward], [backward], [send], m)[0]
    assert exact == pytest.approx(simulate_1f1b(forward, backward, send + [0.0], m), rel=1e-9, abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(stage_sets(st.just(5)), st.integers(1, 16)), min_size=1, max_size=12))
def test_many_plans_with_their_own_micro_batch_counts_are_each_exact(plans):
    forward, backward, send = (np.array([s[k] for s, _ in plans]).reshape(len(plans), -1) for k in range(3))
    counts = np.array([m for _, m in plans])
    together = makespan_s(forward, backward, send, counts)
    for i, ((f, b, x), m) in enumerate(plans):
        assert together[i] == pytest.approx(simulate_1f1b(f, b, x + [0.0], m), rel=1e-9, abs=1e-9)


def test_blocks_of_plans_give_the_same_times_as_one_block(monkeypatch):
    rng = np.random.default_rng(3)
    forward, backward, send = rng.uniform(1, 3, (50, 6)), rng.uniform(2, 6, (50, 6)), rng.uniform(0, 1, (50, 5))
    whole = makespan_s(forward, backward, send, 7)
    monkeypatch.setattr(schedule, "BLOCK_ELEMENTS", 3 * 85)  # 3 plans of 84 operations + the time-0 row
    assert np.array_equal(makespan_s(forward, backward, send, 7), whole)


@pytest.mark.parametrize("p", [1, 2, 3, 6])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_equal_stages_with_free_transfers_give_the_closed_form(p, m):
    forward, backward, free = [1.5] * p, [3.0] * p, [0.0] * (p - 1)
    exact = makespan_s([forward], [backward], [free], m)[0]
    assert exact == pytest.approx(closed_form(forward, backward, free, m))
    assert closed_form(forward, backward, free, m) == pytest.approx((m + p - 1) * 4.5)
    # with paid transfers the end stages exchange with one neighbour only and the closed form is an upper bound
    send = [0.25] * (p - 1)
    exact, bound = makespan_s([forward], [backward], [send], m)[0], closed_form(forward, backward, send, m)
    assert exact <= bound + 1e-12 and (exact < bound - 0.1) == (p >= 3 and m >= 2)


def test_unequal_stages_finish_before_the_closed_form_bound():
    forward, backward, send = [1.0, 3.0, 1.0, 1.0], [2.0, 6.0, 2.0, 2.0], [0.5, 0.0, 0.5]
    exact = makespan_s([forward], [backward], [send], 8)[0]
    assert exact == pytest.approx(simulate_1f1b(forward, backward, send + [0.0], 8))
    assert exact < closed_form(forward, backward, send, 8) - 1


def test_recomputation_runs_before_each_backward():
    rng = np.random.default_rng(5)
    forward, backward, redo = rng.uniform(1, 3, (3, 4, 5))
    send = rng.uniform(0, 1, (4, 4))
    assert np.allclose(makespan_s(forward, backward, send, 6, recompute_s=redo),
                       makespan_s(forward, backward + redo, send, 6), rtol=0, atol=1e-12)
    times = op_times(forward, backward, send, 6, recompute_s=redo)
    b = times.program.backward
    slot = times.program.stage[b]
    assert np.allclose(times.recompute_end_s[:, b] - times.start_s[:, b], redo[:, slot])
    assert np.array_equal(times.recompute_end_s[:, ~b], times.start_s[:, ~b])


def test_op_times_respect_program_order_and_dependencies():
    rng = np.random.default_rng(8)
    times = op_times(rng.uniform(1, 3, (3, 4, 2)), rng.uniform(2, 6, (3, 4, 2)), rng.uniform(0, 1, (3, 3)), 8,
                     virtual_stages=2, wrap_send_s=rng.uniform(0, 1, 3))
    prog = times.program
    has_previous, waits = prog.previous < prog.ops, prog.waits_for < prog.ops
    assert np.all(times.start_s[:, has_previous] >= times.end_s[:, prog.previous[has_previous]] - 1e-12)
    assert np.all(times.start_s[:, waits] >= times.end_s[:, prog.waits_for[waits]] - 1e-12)
    # each operation starts exactly when the later of its two inputs is there
    ready = np.maximum(np.where(has_previous, times.end_s[:, np.minimum(prog.previous, prog.ops - 1)], 0),
                       np.where(waits, times.end_s[:, np.minimum(prog.waits_for, prog.ops - 1)], 0))
    assert np.allclose(times.start_s, ready)
    assert np.array_equal(times.makespan_s, times.end_s.max(-1))


# -- interleaved 1F1B ------------------------------------------------------------------------------------

# p = 2 stages, v = 2 chunks, m = 4 micro-batches, every forward and backward 1 s, free sends, worked by hand:
# stage 0 holds virtual stages 0 and 2, stage 1 virtual stages 1 and 3. Warm-up: stage 0 (2-0-1)*2 + 1*2 = 4
# forwards, stage 1 2; forwards go micro-batches 0 1 on chunk 0, 0 1 on chunk 1, 2 3 on chunk 0, 2 3 on chunk 1,
# the k-th backward on the other chunk. Rows: (kind, chunk, micro-batch, start, end).
HAND_STAGE_0 = [
    ("F", 0, 0, 0, 1), ("F", 0, 1, 1, 2), ("F", 1, 0, 2, 3), ("F", 1, 1, 3, 4),
    ("F", 0, 2, 4, 5), ("B", 1, 0, 5, 6), ("F", 0, 3, 6, 7), ("B", 1, 1, 7, 8),
    ("F", 1, 2, 8, 9), ("B", 0, 0, 9, 10), ("F", 1, 3, 10, 11), ("B", 0, 1, 11, 12),
    ("B", 1, 2, 13, 14), ("B", 1, 3, 15, 16), ("B", 0, 2, 16, 17), ("B", 0, 3, 17, 18),
]
HAND_STAGE_1 = [
    ("F", 0, 0, 1, 2), ("F", 0, 1, 2, 3), ("F", 1, 0, 3, 4), ("B", 1, 0, 4, 5),
    ("F", 1, 1, 5, 6), ("B", 1, 1, 6, 7), ("F", 0, 2, 7, 8), ("B", 0, 0, 8, 9),
    ("F", 0, 3, 9, 10), ("B", 0, 1, 10, 11), ("F", 1, 2, 11, 12), ("B", 1, 2, 12, 13),
    ("F", 1, 3, 13, 14), ("B", 1, 3, 14, 15), ("B", 0, 2, 15, 16), ("B", 0, 3, 16, 17),
]


def test_interleaved_schedule_matches_the_hand_worked_table():
    times = op_times(np.ones((1, 2, 2)), np.ones((1, 2, 2)), np.zeros((1, 1)), 4, virtual_stages=2,
                     wrap_send_s=[0.0])
    prog = times.program
    for stage, table in enumerate([HAND_STAGE_0, HAND_STAGE_1]):
        ops = np.flatnonzero(prog.stage == stage)
        got = [("B" if prog.backward[i] else "F", prog.chunk[i], prog.microbatch[i], times.start_s[0, i],
                times.end_s[0, i]) for i in ops]
        assert got == table
    # the interleaved bubble is (p - 1) / v periods instead of p - 1: 18 s here, 20 s without interleaving
    assert times.makespan_s[0] == 18.0
    assert makespan_s([[2.0, 2.0]], [[2.0, 2.0]], [[0.0]], 4)[0] == 20.0
    assert simulate_interleaved_1f1b([[1, 1], [1, 1]], [[1, 1], [1, 1]], [0.0], 0.0, 4) == 18.0


def test_forward_order_follows_megatrons_own_examples():
    # megatron/core/model_parallel_config.py, microbatch_group_size_per_vp_stage: PP=2 VP=2 with groups of 2
    # and 4 micro-batches runs micro-batches 0 1 0 1 2 3 2 3; with groups of 3 and 5, 0 1 2 0 1 2 3 4 3 4
    for group, m, expected in [(2, 4, [0, 1, 0, 1, 2, 3, 2, 3]), (3, 5, [0, 1, 2, 0, 1, 2, 3, 4, 3, 4])]:
        for rank in range(2):
            forwards = [(c, j) for kind, c, j in stage_program(2, rank, m, 2, group) if kind == "F"]
            assert [j for _, j in forwards] == expected
            assert [c for c, _ in forwards] == [0] * group + [1] * group + [0] * (m - group) + [1] * (m - group)


def test_warm_up_counts_are_megatrons():
    for p, v, m in [(4, 2, 8), (4, 3, 4), (3, 4, 6)]:
        for rank in range(p):
            ops = stage_program(p, rank, m, v)
            warm = next(k for k, (kind, _, _) in enumerate(ops) if kind == "B")
            assert warm == min((p - rank - 1) * 2 + (v - 1) * p, m * v) + (warm < m * v)
    for rank in range(4):  # without interleaving: p - rank - 1
        assert [kind for kind, _, _ in stage_program(4, rank, 8)][:4 - rank] == ["F"] * (4 - rank - 1) + ["F"]


@st.composite
def interleaved_cases(draw):
    p, v = draw(st.integers(2, 5)), draw(st.integers(2, 4))
    group = draw(st.integers(p, 2 * p))
    m = draw(st.integers(group, 3 * group).filter(lambda m: not 0 < m % group < p))
    forward = draw(st.lists(st.lists(seconds, min_size=v, max_size=v), min_size=p, max_size=p))
    backward = draw(st.lists(st.lists(seconds, min_size=v, max_size=v), min_size=p, max_size=p))
    send = draw(st.lists(sends, min_size=p - 1, max_size=p - 1))
    return forward, backward, send, draw(sends), m, group


@settings(max_examples=120, deadline=None)
@given(interleaved_cases())
def test_exact_interleaved_schedule_equals_its_event_simulation(case):
    forward, backward, send, wrap, m, group = case
    exact = makespan_s([forward], [backward], [send], m, virtual_stages=len(forward[0]), wrap_send_s=[wrap],
                       group_size=group)[0]
    assert exact == pytest.approx(simulate_interleaved_1f1b(forward, backward, send, wrap, m, group),
                                  rel=1e-9, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(stage_sets(), st.integers(1, 16))
def test_one_virtual_stage_is_plain_1f1b(stages, m):
    forward, backward, send = stages
    chunked = makespan_s([[[f] for f in forward]], [[[b] for b in backward]], [send], m, virtual_stages=1)[0]
    assert chunked == makespan_s([forward], [backward], [send], m)[0]
    simulated = simulate_interleaved_1f1b([[f] for f in forward], [[b] for b in backward], send, 0.0, m)
    assert simulated == pytest.approx(simulate_1f1b(forward, backward, send + [0.0], m), rel=1e-9, abs=1e-9)


def test_megatrons_interleaving_constraints():
    assert interleaving_error(4, 2, 8, overlap_p2p_comm=False) is None
    assert interleaving_error(4, 1, 7, overlap_p2p_comm=False) is None  # no interleaving, no constraint
    assert "last group of 2" in interleaving_error(4, 2, 10, overlap_p2p_comm=False)  # m % p != 0
    assert interleaving_error(4, 2, 10, 5, overlap_p2p_comm=False) is None  # groups of 5
    assert interleaving_error(4, 2, 10, 6, overlap_p2p_comm=False) is None  # 6 then 4 >= p
    assert "between" in interleaving_error(4, 2, 2, overlap_p2p_comm=False)  # m < p
    assert "between" in interleaving_error(4, 2, 8, 3, overlap_p2p_comm=False)  # group < p
    assert "at least 3" in interleaving_error(2, 2, 4, overlap_p2p_comm=False)
    assert interleaving_error(2, 2, 4) is None  # overlap_p2p_comm is on unless switched off
    assert "at least 2" in interleaving_error(1, 2, 4)
    with pytest.raises(ValueError, match="last group"):
        makespan_s(np.ones((1, 4)), np.ones((1, 4)), np.zeros((1, 3)), 10, virtual_stages=2, wrap_send_s=[0.0])


def test_interleaving_needs_the_wrap_around_send_and_shapes_are_checked():
    with pytest.raises(ValueError, match="wrap_send_s"):
        makespan_s(np.ones((1, 4)), np.ones((1, 4)), np.zeros((1, 3)), 8, virtual_stages=2)
    with pytest.raises(ValueError, match="send_s has shape"):
        makespan_s(np.ones((2, 4)), np.ones((2, 4)), np.zeros((2, 4)), 8)
    with pytest.raises(ValueError, match="backward_s has shape"):
        makespan_s(np.ones((2, 4, 2)), np.ones((2, 4, 3)), np.zeros((2, 3)), 8, virtual_stages=2, wrap_send_s=0.0)


def test_a_cyclic_schedule_is_reported_not_looped_on():
    # two stages whose first operations wait for each other's: index 2 is the time-0 sentinel
    with pytest.raises(RuntimeError, match="deadlocks"):
        schedule._levels(np.array([2, 2]), np.array([1, 0]))


# -- the Gantt chart ---------------------------------------------------------------------------------------


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_timeline_draws_every_segment_of_a_small_schedule(tmp_path):
    p, m = 3, 4
    forward = np.array([[1.0, 2.0, 1.5]])
    times = op_times(forward, 2 * forward, np.array([[0.2, 0.0]]), m, recompute_s=forward)
    out = tmp_path / "charts" / "schedule.png"
    drawn = plot_timeline(times, out)
    count = {kind: drawn[kind]["segments"] for kind in drawn}
    assert count["forward"] == count["backward"] == count["recompute"] == p * m
    assert count["send"] == 2 * m  # only boundary 0 costs time, once per micro-batch each way
    assert count["idle"] >= p  # stage 0 waits for the first gradient, the others for their first input
    busy_s = {"forward": 4.5 * m, "backward": 9.0 * m, "recompute": 4.5 * m, "send": 0.4 * m}
    for kind, seconds in busy_s.items():
        assert drawn[kind]["seconds"] == pytest.approx(seconds)
    assert drawn["idle"]["seconds"] == pytest.approx(p * times.makespan_s[0] - sum(busy_s.values()))
    data = out.read_bytes()
    assert png_size(data) == (1000, int(round((1.4 + 0.45 * p) * 100)))
    assert 10_000 < len(data) < 400_000


def test_timeline_refuses_to_overwrite_an_input_and_odd_suffixes(tmp_path):
    times = op_times(np.ones((1, 2)), np.ones((1, 2)), np.zeros((1, 1)), 2)
    plans = tmp_path / "plans.json"
    plans.write_text("{}")
    with pytest.raises(InputError, match="is an input of this run"):
        plot_timeline(times, tmp_path / "plans.png", inputs=[tmp_path / "plans.png"])
    with pytest.raises(InputError, match="^out_path=.*plans.json: expected a file name ending in .png or .svg"):
        plot_timeline(times, plans)
    assert plans.read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["plans.json"]


def test_the_trace_holds_the_chart_s_segments_in_microseconds(tmp_path):
    """Chrome trace events: one named thread per stage, one complete event per forward, recomputed forward,
    backward and blocking send, each where the schedule puts it; idle time is the gaps."""
    p, m = 3, 4
    forward = np.array([[1.0, 2.0, 1.5]])
    times = op_times(forward, 2 * forward, np.array([[0.2, 0.0]]), m, recompute_s=forward)
    out = tmp_path / "schedule.json"
    drawn = write_trace(times, out, stage_names=["stage 0: A100", "stage 1: A10"])
    assert drawn == plot_timeline(times, tmp_path / "schedule.png")
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {0: "stage 0: A100", 1: "stage 1: A10", 2: "stage 2"}
    spans = [e for e in events if e["ph"] == "X"]
    for kind in ("forward", "recompute", "backward", "send"):
        of_kind = [e for e in spans if e["cat"] == kind]
        assert len(of_kind) == drawn[kind]["segments"]
        assert sum(e["dur"] for e in of_kind) == pytest.approx(drawn[kind]["seconds"] * 1e6)
    for stage in range(p):  # a stage runs one thing at a time, in the schedule's order
        row = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == stage)
        assert all(end <= start * (1 + 1e-12) for (_, end), (start, _) in zip(row, row[1:]))
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(float(times.makespan_s[0]) * 1e6)
    assert {e["name"] for e in spans if e["tid"] == 0 and e["cat"] == "forward"} == {f"forward {i}" for i in range(m)}
    with pytest.raises(InputError, match="^out_path=.*schedule.png: expected a trace file name ending in .json"):
        write_trace(times, tmp_path / "schedule.png")


def test_long_schedules_are_extrapolated_from_their_steady_state(monkeypatch):
    rng = np.random.default_rng(5)
    forward, backward, send = rng.uniform(1, 3, (20, 4)), rng.uniform(1, 6, (20, 4)), rng.uniform(0, 1, (20, 3))
    chunks_f, chunks_b = rng.uniform(1, 3, (20, 4, 2)), rng.uniform(1, 6, (20, 4, 2))
    full = makespan_s(forward, backward, send, 200)
    interleaved = makespan_s(chunks_f, chunks_b, send, 200, virtual_stages=2, wrap_send_s=np.full(20, 0.5))
    monkeypatch.setattr(schedule, "MAX_EXACT_MICROBATCHES", 66)  # interleaved: 64 and 60 micro-batches, whole groups
    assert makespan_s(forward, backward, send, 200) == pytest.approx(full, rel=1e-2)
    assert makespan_s(chunks_f, chunks_b, send, 200, virtual_stages=2, wrap_send_s=np.full(20, 0.5)) == \
        pytest.approx(interleaved, rel=1e-2)


@settings(max_examples=60, deadline=None)
@given(stage_sets(st.integers(1, 12)), st.integers(1, 160), st.floats(0.0, 1.0))
def test_a_steady_state_that_repeats_gives_the_full_schedules_times(stages, extra, redo_share):
    """A plain schedule longer than STEADY_PROBE_MICROBATCHES_PER_STAGE x p micro-batches, timed from the shorter
    one wherever its steady state repeats there (and in full where not), ends where the full evaluation does."""
    forward, backward, send = (np.array([x]) for x in stages)
    redo = redo_share * forward
    m = schedule.STEADY_PROBE_MICROBATCHES_PER_STAGE * forward.shape[1] + extra
    shortcut = schedule.stage_times(forward, backward, send, m, recompute_s=redo)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedule, "STEADY_PROBE_MICROBATCHES_PER_STAGE", 10**6)
        full = schedule.stage_times(forward, backward, send, m, recompute_s=redo)
    assert np.array_equal(shortcut[0], full[0])
    assert shortcut[1] == pytest.approx(full[1], rel=1e-12)


def test_equal_stages_repeat_at_once_and_one_slow_stage_sets_the_period():
    """p equal stages with free sends: every round takes f + b. One stage twice as slow: its f + b."""
    for forward, backward, period in (([1.0] * 4, [2.0] * 4, 3.0), ([1.0, 2.0, 1.0, 1.0], [2.0, 4.0, 2.0, 2.0], 6.0)):
        prog = schedule.program(4, 12)
        _, f, b, redo, links = schedule._inputs([forward], [backward], [[0.0] * 3], 1, None, None)
        end, _ = schedule._evaluate(prog, f, b, redo, links, keep=False)
        period_s, repeats = schedule.steady_rounds(prog, end)
        assert repeats[0] and period_s[0] == pytest.approx(period)
        assert makespan_s([forward], [backward], [[0.0] * 3], 1000)[0] == pytest.approx(
            makespan_s([forward], [backward], [[0.0] * 3], 12)[0] + 988 * period)


@pytest.mark.parametrize("model, cluster", [("gpt2-xl", "fasop-1xA100-7xA10"), ("bert", "fasop-1xA100-3xA10")])
def test_a_plan_files_times_rebuild_its_exact_schedule(model, cluster):
    """The schedule drawn from a plan file's stage (interleaved: chunk) times ends exactly when the search's
    exact schedule did, plain and interleaved, with recomputation or without."""
    from fasop import load_cluster, load_model, search_plans
    from fasop.timeline import plan_op_times

    plans = search_plans(load_model(model), load_cluster(cluster), recompute=("full", "none")).plans
    kinds = {(p.virtual_stages, p.recompute) for p in plans if p.pp > 1}
    assert (2, "none") in kinds and (1, "none") in kinds
    for plan in (p for p in plans if p.pp > 1):
        times = plan_op_times(plan, "plan")
        assert float(times.makespan_s[0]) == pytest.approx(plan.pipeline_time_s, rel=1e-9)
        if plan.virtual_stages > 1:
            assert plan.wrap_send_s is not None and all(len(s.chunks) == plan.virtual_stages for s in plan.stages)


@pytest.mark.parametrize("virtual_stages", [1, 2])
def test_recomputed_forwards_are_drawn_apart_and_the_schedule_still_matches(virtual_stages):
    from fasop import estimate, load_cluster, load_model
    from fasop.timeline import plan_op_times

    model = load_model("gpt2-xl")
    plan = estimate(model, load_cluster("fasop-8xA10"), tp=1, dp=4, pp=8, mbs=1,
                    placement=["A10"] * 8, layers_per_stage=[6] * 8, recompute="full", virtual_stages=virtual_stages)
    times = plan_op_times(plan, "plan")
    assert float(times.makespan_s[0]) == pytest.approx(plan.pipeline_time_s, rel=1e-9)
    redone = times.recompute_end_s[0] - times.start_s[0]
    assert redone.max() > 0 and np.all(redone[~times.program.backward] == 0)
