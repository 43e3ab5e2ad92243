"""The search over stage-group plans (`fasop search --stage-groups`): for each pipeline depth P, micro-batch of B
samples and recompute mode, the integer program of fasop.search.stageilp chooses every stage's node type,
tensor and data-parallel degree and layers under the node counts; the plan it returns is then timed by the exact
schedule, as every plan is (docs/cost-model.md section 11).

Each option of a stage is a node type with degrees (tp, dp) whose tp x dp GPUs fill whole nodes of that type
(tp inside a node); its costs at each stage position are those of the same position in a uniform plan of
those degrees on that type (fasop.cost.stagegroups.uniform_costs). The program's objective is the closed form
every partition of fasop optimises; the one term it cannot see exactly is a send across a boundary whose two
sides differ (it charges each stage the send of its own degrees), which the exact timing then includes.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from fasop.cost.config import Config, param_gather_overlaps, sequence_parallel_on, with_recompute
from fasop.cost.stagegroups import host_labels, host_types, label_places, uniform_costs
from fasop.search.space import Inputs, divisors, max_stages, recompute_modes
from fasop.search.stagegroups import StageGroup, stage_group_record, stage_group_spec
from fasop.search.stageilp import Assignment, StageOptions, solve_stage_ilp

# deepest stage-group pipeline searched: each depth is an integer program of its own, and deeper pipelines
# than this are rarely worth their bubble on clusters fasop plans
MAX_GROUP_STAGES = 16
SOLVE_TIME_LIMIT_S = 60.0  # the whole search's budget for the solver
# each program's share of it: a deep pipeline's program (the lowest lower bounds, so solved first) can take minutes
# to prove, and would leave the shallower ones, which often hold the best plan, no time at all
PROGRAM_TIME_LIMIT_S = 10.0


def option_degrees(inputs: Inputs, batch: int) -> list[tuple[str, int, int]]:
    """Every (node type, tp, dp) a stage may take: tp divides the type's GPUs per node, the heads and the query
    groups and is profiled for its GPU; dp divides the micro-batch; tp x dp fills whole nodes the type has."""
    model, cluster = inputs.model, inputs.cluster
    degrees = []
    for name, node in cluster.node_types.items():
        profiled = inputs.profiles[node.gpu].tensor_degrees
        for tp in divisors(node.gpus_per_node):
            if tp not in profiled or model.num_attention_heads % tp or model.num_query_groups % tp:
                continue
            degrees += [(name, tp, dp) for dp in divisors(batch)
                        if (tp * dp) % node.gpus_per_node == 0 and tp * dp // node.gpus_per_node <= node.count]
    return degrees


def stage_options(inputs: Inputs, pp: int, batch: int, mode: str) -> StageOptions | None:
    """The options of every stage of a `pp`-stage pipeline whose micro-batch holds `batch` samples, under
    recompute mode `mode` (None: no option)."""
    configs = []
    for name, tp, dp in option_degrees(inputs, batch):
        sp = inputs.sequence_parallel and sequence_parallel_on(tp)
        configs.append((name, with_recompute(Config(tp, dp, pp, batch // dp, inputs.gbs, 0, inputs.distributed_optimizer,
                                                    overlap_grad_reduce=inputs.overlap,
                                                    overlap_param_gather=param_gather_overlaps(
                                                        inputs.overlap, inputs.distributed_optimizer),
                                                    sequence_parallel=sp), mode)))
    return options_of(inputs, configs)


def options_of(inputs: Inputs, configs: list[tuple[str, Config]]) -> StageOptions | None:
    """The options (node type, config) of every stage, each costed at every position as the same position of the
    uniform plan `config` on that node type (every config has the same pp); None: no option, or a position that
    no option fits."""
    if not configs:
        return None
    pp = configs[0][1].pp
    columns: dict[str, list[np.ndarray]] = {key: [] for key in ("sum", "layer", "period", "tail_fixed", "tail_layer",
                                                                  "hi")}
    lo = np.zeros(pp, dtype=int)
    for name, config in configs:
        costs = uniform_costs(inputs.model, inputs.cluster, inputs.profiles, name, config, [config.mbs])
        p = costs.problem
        compute = p.period_fixed_s[0] - costs.exchange_s[0]
        sends = np.r_[costs.boundary_s[0], 0.0]
        columns["sum"].append(compute + 2 * sends + np.r_[costs.embedding_allreduce_s[0], np.zeros(pp - 1)])
        columns["layer"].append(p.layer_s[0])
        columns["period"].append(p.period_fixed_s[0])
        columns["tail_fixed"].append(p.ar_fixed_s[0])
        columns["tail_layer"].append(p.ar_layer_s[0])
        columns["hi"].append(p.hi[0])
        lo = np.maximum(lo, np.broadcast_to(p.lo, p.hi.shape)[0])
    table = {key: np.stack(values, axis=1) for key, values in columns.items()}
    if (table["hi"] < lo[:, None]).all(axis=1).any():  # a position that no option fits: no plan
        return None
    nodes = [-(-config.tp * config.dp // inputs.cluster.node_types[name].gpus_per_node) for name, config in configs]
    return StageOptions(node_type=tuple(name for name, _ in configs), tp=np.array([c.tp for _, c in configs]),
                        dp=np.array([c.dp for _, c in configs]), nodes=np.array(nodes), sum_fixed_s=table["sum"],
                        layer_s=table["layer"], period_fixed_s=table["period"], tail_fixed_s=table["tail_fixed"],
                        tail_layer_s=table["tail_layer"], lo=lo, hi=table["hi"].astype(int))


def lower_bound_s(options: StageOptions, num_layers: int, num_microbatches: int) -> float:
    """A lower bound on the program's objective, without solving it: each position at its cheapest option
    holding its fewest layers, the other layers at the fastest rate any option has, and the bottleneck period
    at least the largest position's least period and the average period of those rates."""
    usable = options.hi >= options.lo[:, None]
    least = np.where(usable, options.sum_fixed_s + options.layer_s * options.lo[:, None], np.inf).min(axis=1)
    period = np.where(usable, options.period_fixed_s + options.layer_s * options.lo[:, None], np.inf).min(axis=1)
    fastest = float(np.where(usable, options.layer_s, np.inf).min())
    spare = num_layers - int(options.lo.sum())
    tail = np.where(usable, options.tail_fixed_s + options.tail_layer_s * options.lo[:, None], np.inf).min(axis=1)
    average = (float(np.where(usable, options.period_fixed_s, np.inf).min(axis=1).sum()) + fastest * num_layers) \
        / len(options.lo)
    return float(least.sum() + fastest * spare + (num_microbatches - 1) * max(period.max(), average) + tail.max())


def group_depths(inputs: Inputs) -> range:
    """The pipeline depths a stage-group plan of `inputs` may have."""
    return range(2, min(max_stages(inputs.model), MAX_GROUP_STAGES, inputs.cluster.num_nodes) + 1)


def programs(inputs: Inputs, pp: int) -> list[tuple[float, int, int, str, StageOptions]]:
    """(lower bound, pp, micro-batch, recompute mode, options) of every program of a `pp`-stage pipeline that has
    options, lowest lower bound first (lower_bound_s)."""
    found = [(lower_bound_s(options, inputs.model.num_layers, inputs.gbs // batch), pp, batch, mode, options)
             for batch in divisors(inputs.gbs) for mode in recompute_modes(inputs)
             if (options := stage_options(inputs, pp, batch, mode)) is not None]
    return sorted(found, key=lambda program: program[:4])


def search_stage_groups(inputs: Inputs, upper_bound_s: float = np.inf,
                        time_limit_s: float = SOLVE_TIME_LIMIT_S) -> list[dict]:
    """The best stage-group plan of every pipeline depth, micro-batch and recompute mode whose closed form can be
    below `upper_bound_s` (a plan already found) and below the best such plan found so far, as plan records with
    their `optimality_gap`. Depth by depth, shallow first, the programs are built and the one of lowest lower
    bound (lower_bound_s) solved; then the others in order of their lower bounds; each for at most
    PROGRAM_TIME_LIMIT_S, until the rest cannot pass or `time_limit_s` (building included) is spent."""
    model, cluster = inputs.model, inputs.cluster
    if model.is_encoder_decoder:
        return []
    deadline = time.monotonic() + time_limit_s
    best = upper_bound_s
    rows: list[dict] = []

    def solve(case: tuple) -> None:
        nonlocal best
        bound, pp, batch, mode, options = case
        left = deadline - time.monotonic()
        if bound >= best or left <= 0:
            return
        try:
            found = solve_stage_ilp(options, model.num_layers, inputs.gbs // batch, capacity,
                                    same_degrees_first_last=model.tie_embeddings,
                                    time_limit_s=min(left, PROGRAM_TIME_LIMIT_S),
                                    cutoff_s=best if np.isfinite(best) else None)
        except TimeoutError:  # its share ran out before it found a plan
            return
        row = None if found is None else plan_record(inputs, options, found, pp, batch, mode)
        if found is not None and row is not None:  # None: no labels of the multi-kind nodes fit its stages
            best = min(best, found.objective_s)
            rows.append(row)

    capacity = {name: node.count for name, node in cluster.node_types.items()}
    later = []
    for pp in group_depths(inputs):
        if time.monotonic() >= deadline:
            break
        cases = programs(inputs, pp)
        if cases:
            solve(cases[0])  # the most promising of this depth: shallow ones solve fast and cut off the rest
            later += cases[1:]
    for case in sorted(later, key=lambda c: c[:4]):
        solve(case)
    return [row for row in rows if row.pop("fits_memory")]


def plan_record(inputs: Inputs, options: StageOptions, found: Assignment, pp: int, batch: int, mode: str) -> dict | None:
    """The plan record of the program's assignment, timed by the exact schedule; None when the nodes holding
    several GPU kinds cannot host its stages in pipeline order, or FlagScale cannot label them so (the program
    counts each kind's blocks, not the nodes that hold them)."""
    stages = [StageGroup(options.node_type[j], int(options.tp[j]), int(options.dp[j]), n)
              for j, n in zip(found.option, found.layers)]
    placement = [s.node_type for s, j in zip(stages, found.option) for _ in range(int(options.nodes[j]))]
    cluster = inputs.cluster
    if cluster.hosts:
        labels = label_places([(s.node_type, s.tp, s.dp) for s in stages])
        position_label = [labels[s] for s, j in enumerate(found.option) for _ in range(int(options.nodes[j]))]
        if host_labels(cluster, placement, position_label) is None or any(
                used > cluster.hosts[name].count for name, used in Counter(host_types(cluster, placement)).items()
                if name in cluster.hosts):
            return None
    full = with_recompute(Config(1, 1, pp, 1, inputs.gbs, 0, True), mode)
    spec = stage_group_spec(inputs.model, inputs.cluster, placement=placement, stages=stages,
                            mbs=batch // stages[0].dp, gbs=inputs.gbs, distributed_optimizer=inputs.distributed_optimizer,
                            overlap_grad_reduce=inputs.overlap, recompute=mode, recompute_method=full.recompute_method,
                            recompute_num_layers=full.recompute_num_layers, recompute_modules=inputs.recompute_modules,
                            sequence_parallel=None if inputs.sequence_parallel else False)
    return {**stage_group_record(inputs, spec, "ilp"), "optimality_gap": found.gap}
