"""Plans in several precisions (`--precision bf16,fp8`): the model in each precision, FP8 plans only on the GPU
types that run its recipe, every plan ranked with the others.

Stock Megatron-LM runs one FP8 recipe for the whole model: Transformer Engine's fp8_autocast wraps every
transformer layer of every rank (megatron/core/transformer/transformer_block.py), and a rank whose GPU has no FP8
tensor cores refuses it (transformer_engine/pytorch/quantization.py, check_recipe_support). So an FP8 plan leaves
out the node types whose GPUs cannot run the recipe, and says which and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fasop.cost.fp8 import check_param_gather, recipe_error
from fasop.errors import ArgumentError
from fasop.inputs.catalogue import merged_specs
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import PRECISIONS, Model, with_precision, with_seq_length
from fasop.inputs.profiles import GpuProfile
from fasop.plans import Plan
from fasop.search.engine import SORT_KEYS, SearchResult, cut_of, idle_bests
from fasop.search.headroom import DEFAULT_MEMORY_HEADROOM, over_headroom, search_within_headroom


def plan_model(model: Model, plan: Plan) -> Model:
    """`model` in the precision a plan names (an fp8 plan's recipe and parameter gather with it) and at the
    sequence length it names; a plan that names neither is the model file's."""
    if plan.seq_length is not None:
        model = with_seq_length(model, plan.seq_length)
    if plan.precision is None:
        return model
    return with_precision(model, plan.precision, plan.fp8_recipe, plan.fp8_param_gather)


def parse_precisions(text: str) -> tuple[str, ...]:
    """'bf16,fp8' -> ('bf16', 'fp8'): distinct precisions of PRECISIONS, in the order given."""
    values = tuple(dict.fromkeys(value.strip() for value in text.split(",")))
    unknown = [value for value in values if value not in PRECISIONS]
    if unknown or not values:
        raise ArgumentError("precision", f"expected one or more of {', '.join(PRECISIONS)} separated by commas", text)
    return values


@dataclass(frozen=True)
class PrecisionSpace:
    """One precision's search: the model trained in it, and the cluster's node types that can run it."""

    model: Model
    cluster: Cluster
    left_out: dict[str, str] = field(default_factory=dict)  # node type -> why the precision cannot use it


def fp8_node_types(model: Model, cluster: Cluster) -> PrecisionSpace:
    """The node types of `cluster` whose GPUs run `model`'s FP8 recipe (fasop.cost.fp8.recipe_error), the others
    left out with the reason; none at all is refused in one line naming the GPU types."""
    specs = merged_specs(own=cluster.gpus)
    left_out = {}
    for name, node in cluster.node_types.items():
        spec = specs.get(node.gpu)
        error = (f"GPU {node.gpu} is in no GPU table" if spec is None else recipe_error(spec, model.fp8_recipe))
        if error is not None:
            left_out[name] = error
    if len(left_out) == len(cluster.node_types):
        reasons = "; ".join(sorted(set(left_out.values())))
        raise ArgumentError("precision", f"no GPU type of cluster {cluster.name} can train in FP8 ({reasons})", "fp8")
    kept = {name: node.count for name, node in cluster.node_types.items() if name not in left_out and not node.host}
    return PrecisionSpace(model, cluster.with_counts(kept) if left_out else cluster, left_out)


def precision_spaces(model: Model, cluster: Cluster, precisions: tuple[str, ...] | None = None,
                     fp8_recipe: str | None = None, fp8_param_gather: bool | None = None,
                     use_all: bool = False, distributed_optimizer: bool = True) -> list[PrecisionSpace]:
    """The search space of each precision (default: the model file's); `use_all` refuses an FP8 search that
    would leave node types out."""
    spaces = []
    precisions = precisions or (model.precision,)
    for precision in precisions:
        # the FP8 options apply to the fp8 space; given without one, with_precision refuses them
        fp8 = precision == "fp8" or "fp8" not in precisions
        variant = with_precision(model, precision, fp8_recipe if fp8 else None, fp8_param_gather if fp8 else None)
        check_param_gather(variant, distributed_optimizer)
        space = fp8_node_types(variant, cluster) if variant.fp8 else PrecisionSpace(variant, cluster)
        if use_all and space.left_out:
            name, reason = next(iter(space.left_out.items()))
            raise ArgumentError("use_all", f"FP8 plans cannot use node type {name}: {reason}")
        spaces.append(space)
    return spaces


def search_precisions(spaces: list[PrecisionSpace], profiles: list[dict[str, GpuProfile]], gbs: int | None = None,
                      profiles_dir: str | None = None, *, memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                      keep: int | None = None, places: int | None = None, sort: str = "time",
                      **options: Any) -> SearchResult:
    """search_within_headroom in each precision's space (with its profiles), the plans ranked together: below the
    headroom first, then by `sort`. One precision is that search itself."""
    results = [search_within_headroom(space.model, space.cluster, gbs, profiles_dir, profiles=profiles_of,
                                      memory_headroom=memory_headroom, keep=keep, places=places, sort=sort,
                                      **options)
               for space, profiles_of in zip(spaces, profiles)]
    if len(results) == 1:
        return results[0]
    cluster = spaces[0].cluster  # every precision's cluster has its node types and memory margin

    def rank_key(plan: Plan) -> tuple:
        return (over_headroom(plan, cluster, memory_headroom), getattr(plan, SORT_KEYS[sort]), plan.step_time_s,
                plan.tp, plan.dp, plan.pp, plan.mbs, plan.encoder_stages, tuple(plan.placement), plan.precision or "")

    plans = sorted((plan for result in results for plan in result.plans), key=rank_key)
    cut = cut_of(keep, places, sort)
    if cut:
        plans = cut.kept(plans, lambda plan: rank_key(plan)[:2])
    merged = SearchResult([], sum(r.plans_evaluated for r in results), sum(r.partitions_solved for r in results),
                          sum(r.out_of_memory for r in results), sum(r.pruned for r in results),
                          sum(r.dominated for r in results))
    merged.plans = [plan.model_copy(update={"rank": rank}) for rank, plan in enumerate(plans, start=1)]
    merged.headroom_only = any(result.headroom_only for result in results)
    if not plans:
        closest = min((r for r in results if r.closest_memory_factor is not None),
                      key=lambda r: r.closest_memory_factor or math.inf, default=None)
        if closest is not None:
            merged.closest_memory_factor, merged.closest_plan = closest.closest_memory_factor, closest.closest_plan
    if any(result.idle_bests for result in results):  # the node types each plan leaves idle, of the whole cluster
        full = max((space.cluster for space in spaces), key=lambda c: len(c.node_types))
        merged.idle_bests = idle_bests([{"placement": plan.placement, "step_time_s": plan.step_time_s,
                                         "cost_per_step_usd": plan.cost_per_step_usd} for plan in plans], full)
    return merged
