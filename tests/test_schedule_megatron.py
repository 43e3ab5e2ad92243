"""fasop's pipeline programs against megatron-core's own schedule: each stage runs the same forwards and
backwards of the same micro-batches and model chunks in the same order (CPU import only)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from fasop.cost.schedule import interleaving_error, program

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules",
                                reason="megatron-core is not importable (scripts/install_slurm.sh installs it)")


def megatron_order(stages: int, rank: int, m: int, v: int, group: int) -> list[tuple[str, int, int]]:
    """("F" or "B", chunk, micro-batch) in the order megatron-core runs them on pipeline rank `rank`: its warm-up
    count (get_pp_rank_microbatches) and forward table (get_schedule_table), run as forward_backward_pipelining_
    with_interleaving and _without_interleaving run them: the warm-up forwards, then a forward and a backward at a
    time, then the rest of the backwards. The k-th backward runs on the chunk mirrored from the k-th forward's
    (get_model_chunk_id with forward=False) and takes the oldest micro-batch that chunk holds (input_tensors[chunk]
    .pop(0))."""
    # the only process-group facts it reads: the pipeline size, this rank, and whether the model is chunked
    ranks = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: stages, rank=lambda: rank),
                            virtual_pipeline_model_parallel_size=v if v > 1 else None)
    _, _, warmup, remaining = schedules.get_pp_rank_microbatches(m, v, group, p2p_communicator=ranks)
    table = schedules.get_schedule_table(m, v, group)  # (micro-batch, chunk) of each forward
    held: list[deque[int]] = [deque() for _ in range(v)]
    order: list[tuple[str, int, int]] = []

    def forward(k: int) -> None:
        microbatch, chunk = table[k]
        held[chunk].append(microbatch)
        order.append(("F", chunk, microbatch))

    def backward(k: int) -> None:
        chunk = v - 1 - table[k][1]
        order.append(("B", chunk, held[chunk].popleft()))

    for k in range(warmup):
        forward(k)
    for k in range(remaining):
        forward(warmup + k)
        backward(k)
    for k in range(remaining, warmup + remaining):
        backward(k)
    return order


def fasop_order(stages: int, rank: int, m: int, v: int, group: int) -> list[tuple[str, int, int]]:
    prog = program(stages, m, v, group)
    on_rank = prog.stage == rank
    return [("B" if b else "F", c, j) for b, c, j in zip(prog.backward[on_rank].tolist(), prog.chunk[on_rank].tolist(),
                                                        prog.microbatch[on_rank].tolist())]


def cases(stages: int, v: int) -> list[tuple[int, int]]:
    """(micro-batches, group size) that Megatron runs: for plain 1F1B fewer micro-batches than stages too; for
    interleaving every group size from the stages up, with last groups full or of at least `stages`."""
    if v == 1:
        return [(m, stages) for m in range(1, 3 * stages + 2)]
    return [(m, group) for m in range(stages, 3 * stages + 2) for group in range(stages, m + 1)
            if interleaving_error(stages, v, m, group) is None]


@pytest.mark.parametrize("stages, v", [(p, 1) for p in range(1, 7)] + [(p, v) for p in range(2, 6) for v in (2, 3, 4)])
def test_each_stage_runs_megatron_cores_order(stages, v):
    runs = cases(stages, v)
    assert runs  # not vacuous
    for m, group in runs:
        for rank in range(stages):
            expected = megatron_order(stages, rank, m, v, group)
            assert len(expected) == 2 * m * v
            assert fasop_order(stages, rank, m, v, group) == expected, (stages, rank, m, v, group)
