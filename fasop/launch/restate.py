"""The plan's figures estimated afresh: `fasop emit` refuses a plan file whose figures disagree with its inputs."""

from __future__ import annotations

import math
from typing import Any

from fasop.errors import InputError
from fasop.plans import Plan

FIGURE_TOLERANCE = 1e-6  # relative; a plan written by fasop search re-estimates to within rounding noise


_NOT_FIGURES = ("model", "model_file", "cluster", "cluster_file", "profiles", "synthesised_profiles", "placement_search",
                "fits_memory")


def disagreements(given: Any, fresh: Any, key: str) -> list[tuple[str, Any, Any]]:
    """(key, given, fresh) where `given` (read from a plan file) differs from `fresh`: numbers beyond
    FIGURE_TOLERANCE, everything else exactly; keys that `given` lacks are not compared."""
    if isinstance(fresh, dict) and isinstance(given, dict):
        return [d for k in fresh if k in given for d in disagreements(given[k], fresh[k], f"{key}.{k}".lstrip("."))]
    if isinstance(fresh, list) and isinstance(given, list) and len(given) == len(fresh):
        return [d for i, (g, f) in enumerate(zip(given, fresh)) for d in disagreements(g, f, f"{key}[{i}]")]
    if isinstance(fresh, float) and isinstance(given, (int, float)) and not isinstance(given, bool):
        agree = math.isclose(given, fresh, rel_tol=FIGURE_TOLERANCE, abs_tol=1e-12)
    else:
        agree = type(given) is type(fresh) and given == fresh
    return [] if agree else [(key, given, fresh)]


def restate_plan(plan: Plan, model: Any, cluster: Any, profiles_dir: str | None = None,
                 force: bool = False, where: str | None = None) -> tuple[Plan, str | None]:
    """The plan (3D or stage-groups) to launch and a warning, its figures checked against an estimate made afresh from `model`,
    `cluster` and the profiles (a plan file may be edited by hand, or older than its inputs).

    Refuses a plan whose step time, memory, layer counts or any other figure it states disagrees with the fresh
    estimate (beyond FIGURE_TOLERANCE), or that no longer fits memory; with `force` such a plan is returned
    with the fresh figures, and a warning. Figures the plan file lacks are filled in from the estimate.
    """
    from fasop.cost.price import add_training_run
    from fasop.search import estimate  # the search modules load only when a plan is checked
    from fasop.search.spec import spec_of
    from fasop.search.stagegroups import estimate_stage_groups, spec_of_stage_groups

    where = where or f"plan {plan.rank or '?'}"
    try:
        if plan.is_stage_groups:
            fresh = estimate_stage_groups(model, cluster, spec_of_stage_groups(plan, model, cluster, where),
                                          profiles_dir=profiles_dir)
        else:
            fresh = estimate(model, cluster, spec_of(plan, model, cluster, where), profiles_dir=profiles_dir)
    except InputError as err:
        raise InputError(where, f"cannot be estimated afresh from model {model.name} and cluster {cluster.name} "
                                f"({err})") from None
    fresh_record = fresh.record()
    if plan.train_steps is not None:
        add_training_run(fresh_record, model, plan.train_steps, None)
    figures = {key: value for key, value in fresh_record.items() if key not in _NOT_FIGURES}
    given = plan.record()
    problems = []
    stale = disagreements(given, figures, "")
    if stale:
        key, was, value = stale[0]
        more = f" (and {len(stale) - 1} more figures)" if len(stale) > 1 else ""
        problems.append(f"{key} is {was!r} in the plan file but {value!r} estimated afresh{more}")
    if not fresh.fits_memory:
        problems.append(f"it no longer fits memory ({fresh.peak_memory_gib:.2f} GiB x margin "
                        f"{cluster.memory_margin} + {cluster.gpu_memory_overhead_gib} GiB overhead on GPUs of "
                        f"{fresh.memory_capacity_gib:.2f} GiB)")
    if not problems:
        return Plan.trusted({**figures, **given}), None
    message = "stale plan: " + "; ".join(problems)
    if not force:
        raise InputError(where, f"{message}; search again with the same profiles, or force it out with the fresh "
                                "figures", remedy="force")
    return Plan.trusted({**given, **figures}), f"warning: {where}: {message}; emitted with the fresh figures (forced)"
