"""Plans under profiling error: `fasop search --noise F --trials N --seed S`.

Every measured input of the cost model is uncertain: the profile times, the GPUs' memory bandwidths and the link
bandwidths. Each trial draws one multiplicative factor, uniform in [1 - F, 1 + F], for

  - every (GPU type, unit kind): all profile times of that unit on that GPU type, at every tensor degree and
    micro-batch size, forward and backward alike (a profile error is mostly systematic: a clock, a kernel
    choice, a different software stack),
  - every GPU type: its memory bandwidth, which paces the optimizer step (the bandwidth is divided by the factor,
    so the step takes that many times as long, as a unit's times do), and
  - every (node type, link): the transfer times over its intra-node and over its inter-node link (the
    bandwidth is divided by the factor),

in that order (GPU types and node types sorted by name) from numpy.random.default_rng(S), so a seed gives the
same report on every machine. The factors are independent: a plan whose step time is the maximum of several
independently perturbed terms (a balanced pipeline over two GPU types, an all-reduce through several nodes'
interfaces) is slowed by almost any perturbation, while a plan bound by one term only moves with it.

Only the best CANDIDATES plans of the exact search are re-estimated, each with its own layer partition, as
`fasop estimate` would estimate it; "the best of a trial" is the best of those candidates in that trial (a
plan ranked lower could win a trial, but only by more than the gap that kept it out, which the noise rarely
covers). For each candidate the report gives the fraction of trials in which it is best, and its mean and
worst slowdown against each trial's best (step time, or dollars per step when the search sorts by cost).
The robust ranking orders candidates by mean slowdown.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from fasop.cost.price import cost_per_step_usd, price_per_hour_usd
from fasop.cost.step import breakdown
from fasop.errors import ArgumentError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile, required_kinds
from fasop.plans import Plan
from fasop.search.estimate import plan_costs

CANDIDATES = 20
DEFAULT_TRIALS = 200
# Each trial re-estimates CANDIDATES plans (milliseconds each): 10,000 trials take minutes and state every
# fraction to 0.01%, which is all the report shows; more would only take longer.
MAX_TRIALS = 10_000
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class Robustness:
    exact_rank: int | None  # the plan's rank in the search
    best_fraction: float  # trials in which the plan is the best candidate
    mean_slowdown: float  # mean over trials of metric / best metric - 1
    worst_slowdown: float


def check_noise(noise: float, trials: int, seed: int = 0) -> None:
    if not (math.isfinite(noise) and 0 < noise < 1):
        raise ArgumentError("noise", "expected a fraction in (0, 1), such as 0.2 for +-20%", noise)
    if not 1 <= trials <= MAX_TRIALS:
        raise ArgumentError("trials", f"expected 1 to {MAX_TRIALS:,} trials", trials)
    if not 0 <= seed <= MAX_SEED:
        raise ArgumentError("seed", f"expected a seed from 0 to {MAX_SEED}", seed)


def factor_keys(cluster: Cluster, model: Model) -> list[tuple[str, str, str]]:
    """What each trial's factors apply to, in the order they are drawn."""
    gpus = sorted({t.gpu for t in cluster.node_types.values()})
    units = [("unit", gpu, kind) for gpu in gpus for kind in required_kinds(model)]
    memory = [("memory", gpu, "optimizer") for gpu in gpus]
    return units + memory + [("link", name, link) for name in sorted(cluster.node_types) for link in ("intra", "inter")]


def perturbed(cluster: Cluster, profiles: dict[str, GpuProfile], factors: dict[tuple, float]):
    """(cluster, profiles) with every unit time, optimizer step and link time multiplied by its factor."""
    scaled = {
        gpu: GpuProfile(gpu, profile.file, {
            (tp, kind): c.scaled(factors["unit", gpu, kind])
            for (tp, kind), c in profile.curves.items()})
        for gpu, profile in profiles.items()
    }
    slowed = cluster.with_memory_time_scales({t.gpu: factors["memory", t.gpu, "optimizer"]
                                              for t in cluster.node_types.values()})
    types = {name: replace(t, intra_node_bytes_per_s=t.intra_node_bytes_per_s / factors["link", name, "intra"],
                           inter_node_bytes_per_s=t.inter_node_bytes_per_s / factors["link", name, "inter"])
             for name, t in slowed.node_types.items()}
    return replace(slowed, node_types=types), scaled


def plan_metric(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], plan: Plan, sort: str) -> float:
    """Step time (sort "time") or dollars per step (sort "cost") of a search row, its partition kept."""
    costs, counts = plan_costs(model, cluster, profiles, plan)
    step = float(breakdown(costs, counts)["step_time_s"][0])
    if sort == "cost":
        return cost_per_step_usd(price_per_hour_usd(cluster, plan.placement), step)
    return step


def robustness(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], plans: list[Plan], noise: float,
               trials: int, seed: int, sort: str = "time",
               progress: Callable[[int, int], None] | None = None) -> list[Robustness]:
    """Robustness of each of `plans` (best first, at most CANDIDATES of them), in robust order; `progress(done,
    total)` after each trial."""
    check_noise(noise, trials, seed)
    keys = factor_keys(cluster, model)
    rng = np.random.default_rng(seed)
    draws = rng.uniform(1 - noise, 1 + noise, size=(trials, len(keys)))
    metric = np.empty((trials, len(plans)))
    for trial, row in enumerate(draws):
        trial_cluster, trial_profiles = perturbed(cluster, profiles, dict(zip(keys, row)))
        metric[trial] = [plan_metric(model, trial_cluster, trial_profiles, plan, sort) for plan in plans]
        if progress:
            progress(trial + 1, trials)
    slowdown = metric / metric.min(axis=1, keepdims=True) - 1
    best = np.bincount(metric.argmin(axis=1), minlength=len(plans)) / trials  # ties go to the better exact rank
    result = [Robustness(plan.rank, float(best[i]), float(slowdown[:, i].mean()), float(slowdown[:, i].max()))
              for i, plan in enumerate(plans)]
    # rounded: plans with equal costs would otherwise be ordered by the last bits of their sums
    return sorted(result, key=lambda r: (round(r.mean_slowdown, 12), -r.best_fraction, r.exact_rank))
