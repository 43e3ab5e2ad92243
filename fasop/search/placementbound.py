"""How far the type-blocks placement of a plan can be from the best placement of its degrees: a lower bound on
the closed-form step time of every placement and layer partition of one (tp, dp, pp, micro-batch, recompute
mode), from the integer program of stage-group plans (fasop.search.stageilp).

Where a cluster has more placements than fasop enumerates, fasop search tries type blocks and their rotations
(fasop.search.placement), a heuristic. The program here relaxes the placement instead of enumerating it: each
stage takes an option of the plan's own degrees on one node type (its costs at each position those of the
uniform plan on that type, fasop.search.groupsearch.options_of) and GPUs of any types, integer counts
g[s, type] that add up to the stage's tp x dp GPUs, at least one of them of the option's type; every GPU of the
plan's node types is used (Σ_s g[s, type] = the type's GPUs). A real placement is one assignment of this
program: give each stage the option of its fastest type. The program charges that stage its fastest type's
compute, memory limit and links, which a stage spanning several types never beats (its slowest GPU and slowest
link set its pace, its smallest memory its layers), so its optimum is at most the closed form of the best
placement, when of the types in one stage one is at least as fast in every term (as H100, A100, A10G are).
The gap of a plan is then (its closed form - the bound) / its closed form (docs/cost-model.md section 11).
"""

from __future__ import annotations

from collections import Counter

import pulp

from fasop.plans import Plan
from fasop.search.groupsearch import options_of
from fasop.search.space import Inputs
from fasop.search.spec import spec_of
from fasop.search.stageilp import NO_GAP, SEED, _candidates, _program, _quiet_stdout

BOUND_TIME_LIMIT_S = 10.0  # each bound's solve; a bound stopped early is still a bound (HiGHS's dual bound)


def placement_bound_s(inputs: Inputs, plan: Plan, time_limit_s: float = BOUND_TIME_LIMIT_S) -> float | None:
    """A lower bound on the closed-form step time of every placement and partition of `plan`'s degrees,
    micro-batch and recompute mode on the nodes it uses (module docstring); None where the relaxation does not
    apply: virtual stages, encoder stages, one stage."""
    model, cluster = inputs.model, inputs.cluster
    used = cluster.with_counts(Counter(plan.placement))
    spec = spec_of(plan, model, used)
    if spec.virtual_stages > 1 or spec.encoder_stages or spec.pp < 2:
        return None
    options = options_of(inputs, [(name, spec.config) for name in used.node_types])
    if options is None:
        return None
    gpus = {name: node.count * node.gpus_per_node for name, node in used.node_types.items()}
    unbounded = dict.fromkeys(gpus, spec.pp * len(plan.placement))  # the GPU rows below hold the capacity
    candidates = _candidates(options, model.num_layers, unbounded, tied=False)
    program = _program(options, candidates, model.num_layers, spec.num_microbatches, unbounded, tied=False)
    if program is None:
        return None
    prob, x = program
    stage_gpus = spec.tp * spec.dp
    kinds = list(gpus)
    share = [[prob.add_variable(f"g_{s:03d}_{k:03d}", lowBound=0, upBound=stage_gpus, cat=pulp.LpInteger)
              for k in range(len(kinds))] for s in range(spec.pp)]
    # the types from fastest to slowest by a layer's time (every option has the plan's degrees: one per type)
    pace = {kind: float(options.layer_s[0, options.node_type.index(kind)]) for kind in kinds}
    for s, (js, _) in enumerate(candidates):
        prob += (pulp.lpSum(share[s]) == stage_gpus, f"stage_gpus_{s:03d}")
        for k, kind in enumerate(kinds):
            picked = [variable for variable, j in zip(x[s], js.tolist()) if options.node_type[j] == kind]
            prob += (share[s][k] - pulp.lpSum(picked) >= 0, f"slowest_present_{s:03d}_{k:03d}")
            # a type's GPUs join the stage only when its option's type is no faster
            slower = [variable for variable, j in zip(x[s], js.tolist()) if pace[options.node_type[j]] >= pace[kind]]
            prob += (share[s][k] - stage_gpus * pulp.lpSum(slower) <= 0, f"no_slower_{s:03d}_{k:03d}")
    for k, kind in enumerate(kinds):
        prob += (pulp.lpSum(share[s][k] for s in range(spec.pp)) == gpus[kind], f"every_gpu_{k:03d}")
    solver = pulp.HiGHS(msg=False, threads=1, random_seed=SEED, timeLimit=time_limit_s, gapRel=NO_GAP, gapAbs=0.0)
    with _quiet_stdout():
        prob.solve(solver)
    if prob.sol_status == pulp.LpSolutionInfeasible:
        return None
    return float(prob.solverModel.getInfo().mip_dual_bound)


def placement_gaps(inputs: Inputs, plans: list[Plan], time_limit_s: float = BOUND_TIME_LIMIT_S) -> list[Plan]:
    """`plans`, each whose placement was searched as type blocks with its `optimality_gap`: how far its closed
    form can be above the best placement's (plans of the same shape share one bound); none for plans of context
    parallelism or MoE models."""
    bounds: dict[tuple, float | None] = {}
    result = []
    for plan in plans:
        # the stage-group program prices stages of tp and dp alone: not plans of context or expert parallelism
        plain = (plan.cp or 1) == 1 and plan.ep is None
        if plan.placement_search == "type-blocks" and plan.closed_form_step_s and plain:
            key = (plan.tp, plan.dp, plan.pp, plan.mbs, plan.recompute, plan.virtual_stages,
                   tuple(sorted(Counter(plan.placement).items())))
            if key not in bounds:
                bounds[key] = placement_bound_s(inputs, plan, time_limit_s)
            bound = bounds[key]
            if bound is not None:
                gap = max(0.0, (plan.closed_form_step_s - bound) / plan.closed_form_step_s)
                plan = plan.model_copy(update={"optimality_gap": 0.0 if gap < NO_GAP else gap})
        result.append(plan)
    return result
