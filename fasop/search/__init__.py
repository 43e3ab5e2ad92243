"""The search over parallel plans, and the estimate of a single plan."""

from fasop.search.engine import SearchResult, estimate, search, search_plans

__all__ = ["SearchResult", "estimate", "search", "search_plans"]
