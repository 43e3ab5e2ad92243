"""The Python API's search: the plans as a pandas DataFrame."""

from __future__ import annotations

from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.search.engine import search_plans


def search(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None, **options):
    """Every plan that fits memory as a pandas DataFrame, best first, one row per plan with every cost term.

    Options are those of `search_plans`; `frame.attrs` holds plans_evaluated, partitions_solved,
    out_of_memory, pruned and, when nothing fits, closest_memory_factor and closest_plan.
    """
    import pandas as pd  # only the Python API needs pandas; the command line starts faster without it

    result = search_plans(model, cluster, gbs, profiles_dir, **options)
    frame = pd.DataFrame([plan.record() for plan in result.plans])
    frame.attrs.update(plans_evaluated=result.plans_evaluated, partitions_solved=result.partitions_solved,
                       out_of_memory=result.out_of_memory, pruned=result.pruned)
    if result.closest_plan is not None:
        frame.attrs.update(closest_memory_factor=result.closest_memory_factor, closest_plan=result.closest_plan)
    return frame
