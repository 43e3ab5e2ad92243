"""The search's batched computations against the same computations one at a time: a plan's stage costs on every
encoder/decoder split and placement at once, the tied embedding's all-reduce of every split of a placement, and
the schedule graph built in arrays against its definition operation by operation."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields, replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fasop
from fasop.cost.communication import with_embedding_group, with_embedding_groups
from fasop.cost.config import embedding_stages
from fasop.cost.exact import ScheduleBatch
from fasop.cost.memory import StageMemory
from fasop.cost.problem import PartitionBatch
from fasop.cost.schedule import interleaving_error, program, stage_program
from fasop.cost.step import StageCosts, recompute_variants, stage_costs
from fasop.search.evaluation import plans_of
from fasop.search.space import groups, prepare


def per_row(costs: StageCosts) -> dict[str, object]:
    """Every per-row field of `costs`, those of its partition problem and schedule included."""
    parts = {f"{name}.{f.name}": getattr(getattr(costs, name), f.name)
             for name, kind in (("problem", PartitionBatch), ("schedule", ScheduleBatch), ("memory", StageMemory))
             for f in fields(kind)}
    parts.update({f.name: getattr(costs, f.name) for f in fields(StageCosts)})
    for per_batch in ("problem", "schedule", "memory", "problem.segment_layers", "fixed_layers"):
        parts.pop(per_batch)
    return parts


def same_rows(batched: StageCosts, rows: slice, alone: StageCosts) -> None:
    """Rows `rows` of `batched` hold exactly what `alone` holds, field by field."""
    assert np.array_equal(batched.problem.segment_layers, alone.problem.segment_layers)
    assert np.array_equal(batched.fixed_layers, alone.fixed_layers)
    expected = per_row(alone)
    for name, value in per_row(batched).items():
        if name == "gpu":
            assert value[rows] == expected[name]
        else:
            assert np.array_equal(value[rows], expected[name]), name


@pytest.mark.parametrize("model_name, cluster_name", [("t5", "fasop-1xA100-3xA10"), ("gpt2-xl", "fasop-1xA100-3xA10"),
                                                      ("bert", "fasop-1xA100-3xA10")])
def test_costs_of_every_split_and_placement_at_once_are_each_ones_alone(model_name, cluster_name):
    model, cluster = fasop.load_model(model_name), fasop.load_cluster(cluster_name)
    inputs = prepare(model, cluster)
    plans = plans_of(groups(inputs, [(tp, dp) for tp in (1, 2) for dp in (1, 2, 4)]))
    assert any(len(splits) > 1 for splits in plans) == model.is_encoder_decoder
    for splits in plans:
        mbs_values = splits[0].mbs_values
        for v in (1, 2) if splits[0].config.pp > 2 and not model.is_encoder_decoder else (1,):
            settings_of = [[replace(c, virtual_stages=v) for c in group.variants] for group in splits]
            batched = list(recompute_variants(model, cluster, inputs.profiles,
                                              [(group.geos, configs) for group, configs in zip(splits, settings_of)],
                                              mbs_values))
            for setting, costs in enumerate(batched):
                at = 0
                for group, configs in zip(splits, settings_of):
                    for geo in group.geos:
                        alone = stage_costs(model, cluster, inputs.profiles, geo, configs[setting], mbs_values)
                        same_rows(costs, slice(at, at + len(mbs_values)), alone)
                        at += len(mbs_values)
                assert at == len(costs.mbs)


def test_embedding_all_reduce_of_every_split_at_once_is_each_ones_alone():
    model, cluster = fasop.load_model("t5"), fasop.load_cluster("fasop-1xA100-7xA10")
    inputs = prepare(model, cluster)
    plan = next(splits for splits in plans_of(groups(inputs, [(1, 2)])))
    stage_sets = [embedding_stages(model, group.config) for group in plan]
    assert len({len(stages) for stages in stage_sets}) == 2  # sets of two and of three stages
    for geo in plan[0].geos:
        together = with_embedding_groups(cluster, geo, stage_sets)
        for stages, geo_with in zip(stage_sets, together):
            alone = with_embedding_group(cluster, geo, stages)
            assert (geo_with.embedding_allreduce_s_per_byte, geo_with.embedding_allreduce_latency_s) == \
                   (alone.embedding_allreduce_s_per_byte, alone.embedding_allreduce_latency_s)
            assert alone.embedding_allreduce_s_per_byte > 0


def graph_by_hand(p: int, m: int, v: int, group: int | None):
    """(previous, waits_for, link) of every operation, from each stage's program and the rules of the schedule,
    one operation at a time: a forward waits for the forward one virtual stage up, a backward for the backward
    one virtual stage down (the very last virtual stage's for its own forward); forwards send down, backwards up."""
    rows = [(r, kind, c, j) for r in range(p) for kind, c, j in stage_program(p, r, m, v, group)]
    number = {(kind, r, c, j): i for i, (r, kind, c, j) in enumerate(rows)}
    n, last = len(rows), p * v - 1
    previous, waits_for, link = [], [], []
    for i, (r, kind, c, j) in enumerate(rows):
        previous.append(i - 1 if i and rows[i - 1][0] == r else n)
        s = c * p + r
        if kind == "F":
            waits_for.append(n if s == 0 else number["F", r - 1, c, j] if r else number["F", p - 1, c - 1, j])
            link.append(r if s < last else p)
        else:
            waits_for.append(number["F", r, c, j] if s == last else
                             number["B", r + 1, c, j] if r < p - 1 else number["B", 0, c + 1, j])
            link.append((r - 1 if r else p - 1) if s > 0 else p)
    return previous, waits_for, link


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 12), st.integers(0, 3))
def test_schedule_graph_follows_its_definition(p, v, m, extra_group):
    group = None if extra_group == 0 else p + extra_group - 1
    assume(v == 1 or interleaving_error(p, v, m, group) is None)
    prog = program(p, m, v, group)
    previous, waits_for, link = graph_by_hand(p, m, v, group)
    assert prog.previous.tolist() == previous
    assert prog.waits_for.tolist() == waits_for
    assert prog.link.tolist() == link
    assert prog.stage.tolist() == sorted(prog.stage.tolist()) and len(prog.stage) == 2 * p * m * v


def test_search_loads_the_code_of_no_other_command():
    code = ("import sys; from click.testing import CliRunner; from fasop.cli import main; "
            "r = CliRunner().invoke(main, ['search', '--model', 'bert', '--cluster', 'fasop-4xA10', '--top', '1']); "
            "assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in sys.modules if m.startswith(('fasop.cli.', 'fasop.launch', 'fasop.market'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(["fasop.cli.common", "fasop.cli.run_options", "fasop.cli.search", "fasop.cli.tables"])
