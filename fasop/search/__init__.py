"""The search over parallel plans, and the estimate of a single plan.

    search_plans(model, cluster, ...)  -> SearchResult (plans as records, best first)
    search(model, cluster, ...)        -> the same plans as a pandas DataFrame
    estimate(model, cluster, tp=..., ...) -> the record of one explicit plan
"""

from fasop.search.engine import SearchResult, search_plans
from fasop.search.estimate import estimate
from fasop.search.frame import search

__all__ = ["SearchResult", "estimate", "search", "search_plans"]
