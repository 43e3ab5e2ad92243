"""Megatron-LM's 1F1B pipeline schedule, plain and interleaved, timed exactly for stages of different speeds.

Every operation (a forward or a backward of one micro-batch on one model chunk of one stage) starts when the
previous operation of its stage's program has ended and the operation it depends on has ended:

    start(op) = max(end(previous op of the same stage), end(op it waits for))
    end(op)   = start(op) + recompute(op) + compute(op) + send(op)

A forward waits for the forward of the same micro-batch one virtual stage up, a backward for the backward one
virtual stage down (the very last virtual stage's backward for its own forward); a backward may first
recompute its forward (activation recomputation). Sends are blocking, as in tests/simulate.py: a stage
is busy while it sends what it produced, and the receiver may start once the send has ended. The programs are
Megatron's (docs/cost-model.md section 4.1). The step's pipeline time is the makespan, when the first stage
ends its last backward.

The dependency graph depends only on (stages, virtual stages, micro-batches, group size), so it is built once,
cut into levels (operations whose inputs lie in earlier levels) and evaluated level by level in numpy over
all plans at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

# Plans are evaluated in blocks whose (operations x plans) end times take 32 MiB: wide enough that numpy's cost
# per call (a few calls per level, hundreds of levels) is small against the work, and memory stays bounded.
BLOCK_ELEMENTS = 2**22
# Blocks of at most this many plans gather every operation's durations before the sweep (fewer numpy calls a level);
# larger blocks gather each level's from the small tables of durations, which stay in cache.
GATHER_AHEAD_PLANS = 256
# Schedules of more micro-batches are timed at about this count and one group fewer, and extrapolated: past its
# warm-up the schedule repeats, each micro-batch adding the same time (docs/cost-model.md section 4.1)
MAX_EXACT_MICROBATCHES = 1024
# A plain 1F1B schedule of more micro-batches than this many per stage is first timed with that many: where its
# steady state already repeats there, the rest follows exactly (steady_rounds); other plans are timed in full.
STEADY_PROBE_MICROBATCHES_PER_STAGE = 3


def interleaving_error(stages: int, virtual_stages: int, num_microbatches: int, group_size: int | None = None,
                       *, overlap_p2p_comm: bool = True) -> str | None:
    """Why Megatron-LM refuses an interleaved schedule, or None when it runs it.

    group_size: micro-batches run in a row on one virtual stage (`--microbatch-group-size-per-virtual-pipeline-
    stage`, default the number of stages). The schedule itself (megatron/core/pipeline_parallel/schedules.py,
    forward_backward_pipelining_with_interleaving) needs stages <= group_size <= m and the last group either
    full or at least `stages` long: with the default group, m a multiple of the stages. validate_args in
    megatron/training/arguments.py wants more than 2 stages when `--no-overlap-p2p-communication` turns
    overlap_p2p_comm off, more than 1 otherwise."""
    if virtual_stages == 1:
        return None
    p, m = stages, num_microbatches
    group = p if group_size is None else group_size
    least = 2 if overlap_p2p_comm else 3
    if p < least:
        return (f"interleaving needs at least {least} pipeline stages"
                + ("" if overlap_p2p_comm else " with --no-overlap-p2p-communication"))
    if not p <= group <= m:
        return f"the micro-batch group size {group} must lie between the {p} stages and the {m} micro-batches"
    if 0 < m % group < p:
        return f"{m} micro-batches leave a last group of {m % group}, fewer than the {p} stages"
    return None


def _warmup(stages: int, rank: np.ndarray, virtual_stages: int, group: int, total: int) -> np.ndarray:
    """Forwards each stage `rank` runs before its first backward (schedules.py, get_pp_rank_microbatches)."""
    if virtual_stages == 1:
        return np.minimum(stages - rank - 1, total)
    return np.minimum((stages - rank - 1) * 2 + (virtual_stages - 1) * group, total)


def _chunk_and_microbatch(k: np.ndarray, m: int, virtual_stages: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The model chunk and micro-batch of a stage's k-th forwards: micro-batches go in groups of `group` (the
    last group takes the rest), each group through chunk 0, then chunk 1, ... (schedules.py,
    get_schedule_table)."""
    first = (k // (group * virtual_stages)) * group
    size = np.where(first + group < m, group, m - first)
    offset = k - first * virtual_stages
    return offset // size, first + offset % size


def _programs(stages: int, num_microbatches: int, virtual_stages: int = 1,
              group_size: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(backward, chunk, micro-batch), each (stages, 2 m v): the operations of every stage in the order it runs
    them. Warm-up forwards, then one forward and one backward at a time, then the remaining backwards; the k-th
    backward runs the chunk mirrored from the k-th forward's (schedules.py, get_model_chunk_id with
    forward=False)."""
    v, m = virtual_stages, num_microbatches
    group = stages if group_size is None else group_size
    total = m * v
    warm = _warmup(stages, np.arange(stages), v, group, total)[:, None]
    k = np.arange(total)
    chunk, microbatch = _chunk_and_microbatch(k, m, v, group)
    # where a stage runs its k-th forward and its k-th backward
    forward_at = np.where(k < warm, k, 2 * k - warm)
    backward_at = np.where(k < total - warm, warm + 2 * k + 1, total + k)
    stage = np.arange(stages)[:, None]
    backward = np.zeros((stages, 2 * total), dtype=bool)
    backward[stage, backward_at] = True
    chunks, microbatches = np.empty((stages, 2 * total), dtype=int), np.empty((stages, 2 * total), dtype=int)
    chunks[stage, forward_at], chunks[stage, backward_at] = chunk, v - 1 - chunk
    microbatches[stage, forward_at], microbatches[stage, backward_at] = microbatch, microbatch
    return backward, chunks, microbatches


def stage_program(stages: int, rank: int, num_microbatches: int, virtual_stages: int = 1,
                  group_size: int | None = None) -> list[tuple[str, int, int]]:
    """The operations of one stage in the order it runs them: ("F" or "B", chunk, micro-batch) (`_programs`)."""
    backward, chunk, microbatch = (a[rank] for a in _programs(stages, num_microbatches, virtual_stages, group_size))
    return [("B" if b else "F", c, j) for b, c, j in zip(backward.tolist(), chunk.tolist(), microbatch.tolist())]


@dataclass(frozen=True)
class Program:
    """The schedule's dependency graph. Operations are numbered stage by stage in program order; index `ops`
    (one past the last) stands for "nothing to wait for" (time 0)."""

    stages: int
    virtual_stages: int
    num_microbatches: int
    stage: np.ndarray  # (ops,) the stage that runs it
    chunk: np.ndarray  # (ops,) model chunk on that stage
    microbatch: np.ndarray  # (ops,)
    backward: np.ndarray  # (ops,) bool
    previous: np.ndarray  # (ops,) the operation before it on its stage
    waits_for: np.ndarray  # (ops,) the operation of another virtual stage it needs
    link: np.ndarray  # (ops,) the send after it: boundary j < p - 1, p - 1 the wrap-around, p none
    last: np.ndarray  # (stages,) each stage's last operation
    levels: tuple[np.ndarray, ...]  # operations that can be evaluated together, in order

    @property
    def ops(self) -> int:
        return len(self.stage)

    @cached_property
    def sweep(self) -> tuple[np.ndarray, list[tuple[int, int]], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The operations renumbered level by level, each level a run of consecutive numbers: (the new number of
        each operation and of the sentinel, [start, end) of each level, and in the new order each operation's
        previous and waits_for (new numbers), its row among the compute times (forwards of every chunk, then
        backwards) and its send)."""
        order = np.concatenate(self.levels)
        number = np.empty(self.ops + 1, dtype=int)
        number[order], number[self.ops] = np.arange(self.ops), self.ops
        edges = np.cumsum([0] + [len(ops) for ops in self.levels]).tolist()
        slot = self.stage * self.virtual_stages + self.chunk + np.where(self.backward, self.stages * self.virtual_stages, 0)
        return (number, list(zip(edges[:-1], edges[1:])), number[self.previous[order]], number[self.waits_for[order]],
                slot[order], self.link[order])


@lru_cache(maxsize=256)
def program(stages: int, num_microbatches: int, virtual_stages: int = 1, group_size: int | None = None) -> Program:
    """The dependency graph of Megatron's schedule for these sizes (cached: it depends on nothing else)."""
    p, v, m = stages, virtual_stages, num_microbatches
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"stages {p}, virtual stages {v} and micro-batches {m} must be positive")
    error = interleaving_error(p, v, m, group_size)
    if error:
        raise ValueError(error)
    backward, chunk, microbatch = (a.ravel() for a in _programs(p, m, v, group_size))
    n = len(backward)
    stage = np.repeat(np.arange(p), n // p)  # operations are numbered stage by stage
    number = np.empty((2, p, v, m), dtype=int)  # of each (kind, stage, chunk, micro-batch)
    number[backward.astype(int), stage, chunk, microbatch] = np.arange(n)
    previous = np.where(np.arange(n) % (n // p) > 0, np.arange(n) - 1, n)
    virtual = chunk * p + stage
    last = p * v - 1
    up, down = np.maximum(stage - 1, 0), np.minimum(stage + 1, p - 1)  # clipped: used only where they exist
    # a forward waits for the forward one virtual stage up (the last stage of the chunk before for stage 0)
    forward_waits = np.where(stage > 0, number[0, up, chunk, microbatch],
                             np.where(virtual > 0, number[0, p - 1, np.maximum(chunk - 1, 0), microbatch], n))
    # a backward for the backward one virtual stage down (the first stage of the chunk after for the last
    # stage), the very last virtual stage's for its own forward
    backward_waits = np.where(virtual == last, number[0, stage, chunk, microbatch],
                              np.where(stage < p - 1, number[1, down, chunk, microbatch],
                                       number[1, 0, np.minimum(chunk + 1, v - 1), microbatch]))
    waits_for = np.where(backward, backward_waits, forward_waits)
    # the send after it: forwards down to the next virtual stage, backwards up to the one before
    link = np.where(backward, np.where(virtual > 0, np.where(stage > 0, stage - 1, p - 1), p),
                    np.where(virtual < last, stage, p))
    levels = _levels(previous, waits_for)
    return Program(p, v, m, stage, chunk, microbatch, backward, previous, waits_for, link,
                   np.searchsorted(stage, np.arange(p), side="right") - 1, levels)


def _levels(previous: np.ndarray, waits_for: np.ndarray) -> tuple[np.ndarray, ...]:
    """Level of each operation: one more than the higher level of its two inputs (the sentinel has level 0).
    Each stage's operations are contiguous, so a sweep over the stages, each advancing as far as its inputs
    are known, ends in at most (longest chain) sweeps; a sweep without progress is a deadlocked schedule."""
    n = len(previous)
    previous_of, waits_for_of = previous.tolist(), waits_for.tolist()  # plain lists: this loop visits every operation
    level = [-1] * n + [0]
    heads = [i for i in range(n) if previous_of[i] == n]
    ends = heads[1:] + [n]
    done = 0
    while done < n:
        progress = done
        for s, (i, end) in enumerate(zip(heads, ends)):
            while i < end and level[waits_for_of[i]] >= 0:
                level[i] = 1 + max(level[previous_of[i]], level[waits_for_of[i]])
                i += 1
            done += i - heads[s]
            heads[s] = i
        if done == progress:
            raise RuntimeError("the schedule deadlocks: an operation waits for one that never runs")
    levels = np.array(level[:n])
    order = np.argsort(levels, kind="stable")
    return tuple(np.split(order, np.flatnonzero(np.diff(levels[order])) + 1))


@dataclass(frozen=True)
class OpTimes:
    """When every operation of `program` runs in each plan, in seconds from the start of the step; each array
    is (plans, ops). An operation is [start, recompute_end) recomputing its forward (backwards with
    recomputation only), [recompute_end, compute_end) computing, [compute_end, end) sending."""

    program: Program
    start_s: np.ndarray
    recompute_end_s: np.ndarray
    compute_end_s: np.ndarray
    end_s: np.ndarray

    @property
    def makespan_s(self) -> np.ndarray:
        return self.end_s[:, self.program.last].max(-1)


def _per_chunk(times, plans: int, p: int, v: int, name: str) -> np.ndarray:
    """(plans, p) or (plans, p, v) seconds as (plans, p * v), chunk fastest; (plans, p) is every chunk's."""
    a = np.asarray(times, dtype=float)
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], v, axis=2)
    if a.shape != (plans, p, v):
        raise ValueError(f"{name} has shape {np.shape(times)}; expected ({plans}, {p}) or ({plans}, {p}, {v})")
    return a.reshape(plans, p * v)


def _inputs(forward_s, backward_s, send_s, virtual_stages, wrap_send_s, recompute_s):
    forward = np.asarray(forward_s, dtype=float)
    if forward.ndim not in (2, 3):
        raise ValueError(f"forward_s has shape {forward.shape}; expected (plans, stages[, virtual stages])")
    plans, p, v = forward.shape[0], forward.shape[1], virtual_stages
    send = np.asarray(send_s, dtype=float)
    if send.shape != (plans, p - 1):
        raise ValueError(f"send_s has shape {send.shape}; expected ({plans}, {p - 1})")
    if v > 1 and wrap_send_s is None:
        raise ValueError("an interleaved schedule needs wrap_send_s, the send from the last stage to the first")
    wrap = np.zeros(plans) if wrap_send_s is None else np.broadcast_to(np.asarray(wrap_send_s, float), (plans,))
    links = np.concatenate([send, wrap[:, None], np.zeros((plans, 1))], axis=1)  # indexed by Program.link
    recompute = np.zeros((plans, p)) if recompute_s is None else recompute_s
    return (p, _per_chunk(forward, plans, p, v, "forward_s"), _per_chunk(backward_s, plans, p, v, "backward_s"),
            _per_chunk(recompute, plans, p, v, "recompute_s"), links)


def _evaluate(prog: Program, forward, backward, recompute, links, keep: bool):
    """End times (ops + 1, plans) of one block of plans, rows in `Program.sweep` order (operation op at row
    number[op], the sentinel last), so that each level is a run of rows; with keep, also the start times."""
    _, levels, previous, waits_for, slot, link = prog.sweep
    compute = np.concatenate([forward.T, recompute.T + backward.T])  # (2 p v, plans): forwards, then backwards
    send = links.T
    # each level's rows of those small tables; for few plans, every operation's row is gathered once instead
    rows: list[tuple[np.ndarray | slice, np.ndarray | slice]] = [(slot[a:b], link[a:b]) for a, b in levels]
    if forward.shape[0] <= GATHER_AHEAD_PLANS:
        compute, send, rows = compute[slot], send[link], [(slice(a, b), slice(a, b)) for a, b in levels]
    end = np.zeros((prog.ops + 1, forward.shape[0]))
    start = np.empty_like(end)
    for (a, b), (compute_rows, send_rows) in zip(levels, rows):
        begin = np.maximum(end[previous[a:b]], end[waits_for[a:b]])
        end[a:b] = begin + compute[compute_rows] + send[send_rows]
        if keep:
            start[a:b] = begin
    return end, (start if keep else None)


def makespan_s(forward_s, backward_s, send_s, num_microbatches, *, virtual_stages: int = 1, wrap_send_s=None,
               recompute_s=None, group_size: int | None = None) -> np.ndarray:
    """Pipeline time of each plan (plans,) under Megatron's 1F1B schedule, interleaved when virtual_stages > 1.

    forward_s, backward_s, recompute_s: seconds of one micro-batch on one model chunk of each stage,
    (plans, stages) or (plans, stages, virtual_stages); recompute_s (default none) is the forward recomputed
    at the start of each backward. send_s: (plans, stages - 1) seconds of one transfer across each boundary;
    wrap_send_s: (plans,) from the last stage to the first, which interleaving needs. num_microbatches: one
    count for all plans or one per plan (plans with equal counts are evaluated together)."""
    return stage_times(forward_s, backward_s, send_s, num_microbatches, virtual_stages=virtual_stages,
                       wrap_send_s=wrap_send_s, recompute_s=recompute_s, group_size=group_size)[1].max(-1)


def stage_times(forward_s, backward_s, send_s, num_microbatches, *, virtual_stages: int = 1, wrap_send_s=None,
                recompute_s=None, group_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(first start, last end), each (plans, stages): when each stage starts its first operation (its first
    forward, once its input has arrived) and when it ends its last (its last backward, send included).
    Arguments as makespan_s."""
    p, forward, backward, recompute, links = _inputs(forward_s, backward_s, send_s, virtual_stages, wrap_send_s,
                                                     recompute_s)
    plans = forward.shape[0]
    counts = np.broadcast_to(np.asarray(num_microbatches), (plans,))
    first, last = np.empty((plans, p)), np.empty((plans, p))

    def blocks(m: int, rows: np.ndarray):
        """(program, rows of a block, end times) of the schedule of m micro-batches, block by block; each
        block's `first` and `last` written."""
        prog = program(p, m, virtual_stages, group_size)
        heads = np.r_[0, prog.last[:-1] + 1]
        block = max(1, BLOCK_ELEMENTS // (prog.ops + 1))
        for at in range(0, len(rows), block):
            part = rows[at:at + block]
            end, _ = _evaluate(prog, forward[part], backward[part], recompute[part], links[part], keep=False)
            number = prog.sweep[0]
            first[part], last[part] = end[number[prog.waits_for[heads]]].T, end[number[prog.last]].T
            yield prog, part, end

    def run(m: int, rows: np.ndarray) -> None:
        for _ in blocks(m, rows):
            pass

    def steady(m: int, rows: np.ndarray) -> np.ndarray:
        """Time the rows' schedules of m micro-batches from a shorter one where its steady state repeats
        (steady_rounds); the rows left to time in full."""
        probe = STEADY_PROBE_MICROBATCHES_PER_STAGE * p
        left = []
        for prog, part, end in blocks(probe, rows):
            period_s, repeats = steady_rounds(prog, end)
            last[part[repeats]] += (m - probe) * period_s[repeats, None]
            left.append(part[~repeats])
        return np.concatenate(left)

    for m in np.unique(counts):
        rows = np.flatnonzero(counts == m)
        if virtual_stages == 1 and m > STEADY_PROBE_MICROBATCHES_PER_STAGE * p:
            rows = steady(int(m), rows)
            if not len(rows):
                continue
        if m <= MAX_EXACT_MICROBATCHES:
            run(int(m), rows)
            continue
        # the steady state adds the same time per micro-batch: extrapolate from two exact counts a group apart
        # (interleaved schedules run only whole groups)
        step = 1 if virtual_stages == 1 else (group_size or p)
        top = MAX_EXACT_MICROBATCHES // step * step
        run(top - step, rows)
        before = last[rows].copy()
        run(top, rows)
        last[rows] += (m - top) * (last[rows] - before) / step
    return first, last


def steady_rounds(prog: Program, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whether a plain 1F1B schedule (prog, end times of a block of plans as _evaluate gives them) has reached
    its period, and that period, per plan. Round r of stage i is its forward of micro-batch (p - 1 - i) + r and
    its backward of micro-batch r; from the first round to round m - p every stage runs one such pair a round,
    and round r + 1 is a max-plus function of round r alone (its forwards wait for round r one stage up, its
    backwards for round r + 1 one stage down, each after its own stage's previous operation), so shifting every
    operation of round r by t shifts round r + 1, and every later one, by t (max and + commute with adding t).
    Where the last such round, m - p, ends every operation the same `period_s` after round m - p - 1 (to 1e-12
    of the times: the map is non-expansive, so that much can grow by no more than itself per round), every
    later round, and the remaining backwards after them, whose pattern does not depend on m, shift by
    `period_s` per micro-batch: a schedule of m' > m micro-batches ends (m' - m) period_s later at every
    stage. The operations of a stage are numbered from i 2m in program order."""
    p, m = prog.stages, prog.num_microbatches
    stage = np.arange(p)
    at = stage * 2 * m + (p - 1 - stage) + 2 * (m - p)  # the forward of round m - p on each stage
    ops = np.concatenate([at, at + 1])
    number = prog.sweep[0]
    now, before = end[number[ops]], end[number[ops - 2]]
    steps = now - before
    period_s = steps[0]
    repeats = np.all(np.abs(steps - period_s) <= 1e-12 * np.abs(now).max(axis=0), axis=0)
    return period_s, repeats


def op_times(forward_s, backward_s, send_s, num_microbatches: int, *, virtual_stages: int = 1, wrap_send_s=None,
             recompute_s=None, group_size: int | None = None) -> OpTimes:
    """The start and end of every operation of every plan (arguments as makespan_s, one micro-batch count),
    for drawing the schedule (fasop/timeline.py)."""
    p, forward, backward, recompute, links = _inputs(forward_s, backward_s, send_s, virtual_stages, wrap_send_s,
                                                     recompute_s)
    prog = program(p, int(num_microbatches), virtual_stages, group_size)
    end, start = (times[prog.sweep[0]] for times in _evaluate(prog, forward, backward, recompute, links, keep=True))
    slot = prog.stage * virtual_stages + prog.chunk
    start = start[:-1].T
    redo = np.where(prog.backward, recompute[:, slot], 0.0)
    compute = np.where(prog.backward, backward[:, slot], forward[:, slot])
    return OpTimes(prog, start, start + redo, start + redo + compute, end[:-1].T)
