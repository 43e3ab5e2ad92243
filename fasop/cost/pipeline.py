"""The pipeline schedule, Megatron-LM's 1F1B: how many micro-batches each stage holds, and the time of the
pipeline from per-stage compute and sends (docs/cost-model.md section 4; tests/simulate.py runs the same
schedule event by event)."""

from __future__ import annotations

from functools import cache

import numpy as np

from fasop.cost.schedule import interleaving_error, program


def in_flight(pp: int, num_microbatches: np.ndarray, virtual_stages: int = 1) -> np.ndarray:
    """(K, pp): micro-batches whose activations stage s holds at once under 1F1B, min(pp - s, m); interleaved,
    the most model chunks whose forward has run and backward has not, counted along the stage's program, over
    v (each chunk holds 1/v of the stage's layers). Counts Megatron does not run interleaved get the plain one."""
    plain = np.minimum(pp - np.arange(pp)[None, :], num_microbatches[:, None]).astype(float)
    if virtual_stages == 1:
        return plain
    for m in np.unique(num_microbatches):
        if interleaving_error(pp, virtual_stages, int(m)) is None:
            # the count is the warm-up's forwards plus one, which stops growing long before 8 micro-batches a stage
            counted = min(int(m), 8 * pp)
            plain[num_microbatches == m] = np.array(_most_chunks(pp, counted, virtual_stages)) / virtual_stages
    return plain


def end_chunks_in_flight(pp: int, num_microbatches: np.ndarray, virtual_stages: int = 1) -> np.ndarray:
    """(K, 2): micro-batches whose activations the first stage's first model chunk (the embedding's) and the last
    stage's last chunk (the head's) hold at once: min(pp, m) and 1 under 1F1B; interleaved, counted along the
    stages' programs (the last stage runs each micro-batch's backward of its last chunk right after its forward)."""
    ends = np.stack([np.minimum(pp, num_microbatches), np.ones_like(num_microbatches)], axis=-1).astype(float)
    if virtual_stages == 1:
        return ends
    for m in np.unique(num_microbatches):
        if interleaving_error(pp, virtual_stages, int(m)) is None:
            ends[num_microbatches == m] = _end_chunks(pp, min(int(m), 8 * pp), virtual_stages)
    return ends


@cache
def _end_chunks(pp: int, m: int, virtual_stages: int) -> tuple[int, int]:
    prog = program(pp, m, virtual_stages)
    first = np.r_[0, prog.last[:-1] + 1]
    ends = []
    for stage, chunk in ((0, 0), (pp - 1, virtual_stages - 1)):
        ops = slice(first[stage], prog.last[stage] + 1)
        mine = prog.chunk[ops] == chunk
        ends.append(int(np.cumsum(np.where(prog.backward[ops][mine], -1, 1)).max()))
    return ends[0], ends[1]


@cache
def _most_chunks(pp: int, m: int, virtual_stages: int) -> tuple[int, ...]:
    prog = program(pp, m, virtual_stages)
    held = np.cumsum(np.where(prog.backward, -1, 1))  # operations are numbered stage by stage in program order
    first = np.r_[0, prog.last[:-1] + 1]
    return tuple(int((held[a:b + 1] - (held[a - 1] if a else 0)).max()) for a, b in zip(first, prog.last))


def pipeline_terms(compute_s: np.ndarray, exchange_s: np.ndarray, boundary_s: np.ndarray,
                   num_microbatches: np.ndarray) -> dict[str, np.ndarray]:
    """(K,) pipeline time, its bubble and its point-to-point part: every micro-batch passes every stage once,
    and the m - 1 others follow at the pace of the slowest stage's steady-state period (compute and sends)."""
    m = num_microbatches
    period = compute_s + exchange_s
    boundary = 2 * boundary_s.sum(-1)
    bottleneck = period.argmax(-1)
    pipeline = compute_s.sum(-1) + boundary + (m - 1) * period.max(-1)
    return {
        "pipeline_time_s": pipeline,
        "bubble_s": pipeline - m * compute_s.max(-1),
        "p2p_s": boundary + (m - 1) * np.take_along_axis(exchange_s, bottleneck[:, None], -1)[:, 0],
    }
