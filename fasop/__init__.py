"""fasop: plans for training Transformers with Megatron-LM on clusters that mix GPU types.

    import fasop
    model, cluster = fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-1xA100-7xA10")
    plans = fasop.search(model, cluster)

returns a pandas DataFrame of every plan that fits memory, best first. The commands' work, without their printing:

    fasop.search_plans(model, cluster)     every plan that fits as Plan records, best first (a SearchResult)
    fasop.search_within_headroom(model, cluster)
                                           fasop search: the same ranked as the command ranks them, plans above
                                           90% of usable GPU memory (memory_headroom) after the others
    fasop.estimate(model, cluster, ...)    fasop estimate: one plan's full breakdown
    fasop.estimate_stage_groups(model, cluster, fasop.stage_group_spec(model, cluster, ...))
                                           the same for a plan whose stages (fasop.StageGroup) have their own GPU
                                           type, tp and dp
    fasop.pareto(model, cluster, ...)      fasop pareto: each composition's best plan and the Pareto front (a DataFrame)
    fasop.compare(model, cluster)          fasop compare: the strategy families side by side (a list of Family)
    fasop.emit(plan, model, cluster, dir)  fasop emit: the plan estimated afresh, its launch scripts written
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fasop.errors import InputError
from fasop.inputs.cluster import Cluster, load_cluster
from fasop.inputs.model import Model, load_model
from fasop.search import (
    PlanSpec,
    StageGroup,
    estimate,
    estimate_stage_groups,
    plan_spec,
    search,
    search_plans,
    search_within_headroom,
    stage_group_spec,
)

if TYPE_CHECKING:
    from fasop.launch.write import emit
    from fasop.market.choice import pareto
    from fasop.search.compare import compare

__all__ = ["Cluster", "InputError", "Model", "PlanSpec", "StageGroup", "compare", "emit", "estimate",
           "estimate_stage_groups", "load_cluster", "load_model", "pareto", "plan_spec", "search", "search_plans",
           "search_within_headroom", "stage_group_spec"]
__version__ = "0.1.0"

# Every command imports this package when it starts: the sweep, the strategy families and the launch scripts
# (with pandas, for pareto's DataFrame, only when called) load when first named here, not on each start.
_LAZY = {"pareto": "fasop.market.choice", "compare": "fasop.search.compare", "emit": "fasop.launch.write"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fasop' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
