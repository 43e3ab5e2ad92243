"""The search over parallel plans, and the estimate of a single plan.

    search_plans(model, cluster, ...)  -> SearchResult (plans as records, best first)
    search_within_headroom(model, cluster, ...) -> the same, ranked as `fasop search` ranks them: plans above
                                       the memory headroom (default 90% of usable GPU memory) after the others
    search(model, cluster, ...)        -> the same plans as a pandas DataFrame
    plan_spec(model, cluster, tp=..., ...) -> PlanSpec, one explicit plan checked
    estimate(model, cluster, spec)       -> its record (or estimate(model, cluster, tp=..., ...))
    stage_group_spec(model, cluster, placement=..., stages=[StageGroup(...), ...], mbs=...)
                                       -> StageGroupSpec, a plan whose stages have their own GPU type, tp and dp
    estimate_stage_groups(model, cluster, spec) -> its record
"""

from fasop.search.engine import SearchResult, search_plans
from fasop.search.estimate import estimate
from fasop.search.frame import search
from fasop.search.headroom import search_within_headroom
from fasop.search.spec import PlanSpec, plan_spec
from fasop.search.stagegroups import StageGroup, estimate_stage_groups, stage_group_spec

__all__ = ["PlanSpec", "SearchResult", "StageGroup", "estimate", "estimate_stage_groups", "plan_spec", "search",
           "search_plans", "search_within_headroom", "stage_group_spec"]
