"""The estimate of one explicit plan: the same cost model and record as the search, for a plan given by hand or
read from a plan file."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from fasop.cost.communication import Geometry, geometry, with_embedding_group
from fasop.cost.config import embedding_stages
from fasop.cost.memory import usable_gib
from fasop.cost.step import StageCosts, stage_costs
from fasop.errors import ArgumentError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile
from fasop.plans import Plan
from fasop.search.record import plan_rows
from fasop.search.space import prepare
from fasop.search.spec import PlanSpec, plan_spec, spec_of


def estimate(model: Model, cluster: Cluster, spec: PlanSpec | None = None, /, *, profiles_dir: str | None = None,
             profiles: dict[str, GpuProfile] | None = None, **fields: Any) -> Plan:
    """The full breakdown of one plan: `spec`, or the plan that `fields` give plan_spec (tp=..., dp=..., pp=...,
    mbs=..., placement=[...], layers_per_stage=[...] and its options). `profiles`: already loaded profiles (by GPU
    type) instead of reading profiles_dir (default: the model's bundled ones, GPU types without one synthesised)."""
    if spec is None:
        spec = plan_spec(model, cluster, **fields)
    elif fields:
        raise TypeError(f"estimate takes a PlanSpec or its fields, not both ({', '.join(fields)} given)")
    sub = cluster.with_counts(Counter(spec.placement))
    inputs = prepare(model, sub, spec.gbs, profiles_dir, spec.distributed_optimizer, profiles)
    unprofiled = sorted(gpu for gpu, profile in inputs.profiles.items() if spec.tp not in profile.tensor_degrees)
    if unprofiled:
        raise ArgumentError("tp", f"the profiles of {', '.join(unprofiled)} have no rows for tensor-parallel degree "
                                  f"{spec.tp}", spec.tp)
    costs, counts, geo = _costs(model, sub, inputs.profiles, spec)
    row = plan_rows(inputs, [(spec.config, geo, True)], costs, counts)[0]
    row["fits_memory"] = all(s["memory_gib"] <= usable_gib(cluster, s["memory_capacity_gib"]) for s in row["stages"])
    return Plan.trusted(row)


def plan_costs(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], plan: Plan) -> tuple[StageCosts, np.ndarray]:
    """The stage costs of a plan the search returned, on `cluster` and `profiles` (perturbed ones, say), and its
    partition as the layer counts those costs take (K = 1 row)."""
    costs, counts, _ = _costs(model, cluster, profiles, spec_of(plan, model, cluster))
    return costs, counts


def _costs(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile],
           spec: PlanSpec) -> tuple[StageCosts, np.ndarray, Geometry]:
    """The plan's stage costs, its layer counts as those costs take them (K = 1 row) and its rank geometry."""
    experts = (spec.ep, spec.etp) if model.is_moe else None
    geo = with_embedding_group(cluster, geometry(cluster, spec.placement, spec.tp, spec.dp, spec.pp, spec.cp, experts),
                               embedding_stages(model, spec.config))
    costs = stage_costs(model, cluster, profiles, geo, spec.config, [spec.mbs])
    return costs, (np.array(spec.layers_per_stage) - costs.fixed_layers)[None, :], geo
