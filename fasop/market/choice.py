"""Which composition to rent within a budget or a deadline, with a margin for the error of the estimates, and the
sweep and choice together as `fasop pareto` and the Python API's `fasop.pareto` run them.

    from fasop.market.pareto import compositions, sweep
    from fasop.market.choice import choose
    records = sweep(model, cluster, compositions(cluster), train_steps=10_000)
    best, message = choose(records, budget_usd=5_000)

A run meets a limit when its estimate times 1 + margin does: measured runs took 1.08 to 1.30 times fasop's
estimate (docs/validation.md; fasop.inputs.errorband), and a run chosen at 599.7 h for a deadline of 600 h would
most likely miss it. The default margin is the slow end of the error band, and the message says the margin used
and what the chosen run takes at the band's slow end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fasop.errors import ArgumentError
from fasop.inputs.cluster import Cluster
from fasop.inputs.errorband import ErrorBand, band_of
from fasop.inputs.model import Model
from fasop.market.frontfile import INT_COLUMNS, NODES_PREFIX
from fasop.market.pareto import best_of_precisions, check_limits, composition_label, compositions, degrees_text, sweep
from fasop.market.rent import MAX_POINTS, RENT_TIME_LIMIT_S, RentFront, rent_front

MAX_MARGIN = 10.0  # a margin of 1,000%: beyond that no estimate is worth choosing by


def check_margin(margin: float | None) -> None:
    """A margin, when given, is a fraction from 0 to MAX_MARGIN."""
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not 0 <= margin <= MAX_MARGIN):
        raise ArgumentError("margin", f"expected a fraction from 0 to {MAX_MARGIN:g} (0.3: 30% longer and dearer "
                                      "than estimated)", margin)


def _describe(record: dict) -> str:
    tp, dp = degrees_text(record)
    return (f"{composition_label(record, unit=True)} (tp={tp} dp={dp} pp={record['pp']} "
            f"mbs={record['mbs']}): {record['train_hours']:,.2f} h, ${record['train_cost_usd']:,.2f}")


@dataclass(frozen=True)
class _Margin:
    """Estimates stretched by 1 + `fraction` before they are held against a limit, and how to say so."""

    fraction: float
    band: ErrorBand
    from_band: bool  # the fraction is the band's slow end, not one given

    def __call__(self, value: float) -> float:
        return value * (1 + self.fraction)

    @property
    def words(self) -> str:
        origin = f"the slow end of the error band, {self.band.source}" if self.from_band else "given"
        return f"with a {self.fraction:.0%} margin ({origin})"

    def slow_end(self, record: dict) -> str:
        return (f"; at the band's slow end ({self.band.high:.2f}x) {self.band.high * _hours(record):,.2f} h, "
                f"${self.band.high * _cost(record):,.2f}")


def _hours(record: dict) -> float:
    return record["train_hours"]


def _cost(record: dict) -> float:
    return record["train_cost_usd"]


def _choose_within(feasible: list[dict], limit: float, measure, other, margin: _Margin,
                   texts: tuple[str, str]) -> tuple[dict | None, str]:
    """One limit on `measure` (cost or hours), held against the measure with its margin: the run that is best by
    `other` within it (ties: the better by `measure`), else None and how far the best run by `measure` misses it;
    texts: (found, missed as a format of near, miss and pct)."""
    meets = [r for r in feasible if margin(measure(r)) <= limit]
    if meets:
        best = min(meets, key=lambda r: (other(r), measure(r)))
        return best, f"{texts[0]}: {_describe(best)}{margin.slow_end(best)}"
    near = min(feasible, key=lambda r: (measure(r), other(r)))
    miss = margin(measure(near)) - limit
    return None, texts[1].format(near=_describe(near), miss=miss, pct=100 * miss / limit)


def choose(records: list[dict], budget_usd: float | None = None, deadline_hours: float | None = None,
           margin: float | None = None, band: ErrorBand | None = None) -> tuple[dict | None, str]:
    """The composition that meets the constraint best, and a one-line message saying so.

    A run meets a limit when its estimate times 1 + `margin` does: estimates err (docs/validation.md), and the
    margin keeps a choice from landing just inside a limit it then misses. Default margin: the slow end of the
    error `band` (default: the bundled band of published runs, fasop.inputs.errorband), which the message also
    applies to the chosen run.
    - budget only: the fastest run whose cost is within the budget (ties: the cheaper);
    - deadline only: the cheapest run that ends within the deadline (ties: the faster);
    - both: the cheapest run that meets both (ties: the faster).
    When none qualifies: (None, a message naming the closest composition and how far it misses: the
    cheapest for a budget, the fastest for a deadline, and for both the one whose worse overshoot, in
    percent of its limit, is smallest). With neither limit: (None, "").
    """
    check_limits(budget_usd, deadline_hours)
    check_margin(margin)
    if budget_usd is None and deadline_hours is None:
        return None, ""
    feasible = [r for r in records if r.get("feasible")]
    if not feasible:
        return None, "no composition has a plan that fits in memory"
    band = band_of(band)
    stretch = _Margin(band.slow_margin if margin is None else float(margin), band, margin is None)
    if budget_usd is not None and deadline_hours is not None:
        return _choose_within_both(feasible, budget_usd, deadline_hours, stretch)
    if budget_usd is not None:
        return _choose_within(feasible, budget_usd, _cost, _hours, stretch, (
            f"fastest within the budget of ${budget_usd:,.2f} {stretch.words}",
            f"no composition fits the budget of ${budget_usd:,.2f} {stretch.words}; the cheapest, {{near}}, is "
            "${miss:,.2f} ({pct:.1f}%) over"))
    assert deadline_hours is not None  # one of the two limits is given (checked above)
    return _choose_within(feasible, deadline_hours, _hours, _cost, stretch, (
        f"cheapest within the deadline of {deadline_hours:,.2f} h {stretch.words}",
        f"no composition meets the deadline of {deadline_hours:,.2f} h {stretch.words}; the fastest, {{near}}, takes "
        "{miss:,.2f} h ({pct:.1f}%) longer"))


def _choose_within_both(feasible: list[dict], budget_usd: float, deadline_hours: float,
                        margin: _Margin) -> tuple[dict | None, str]:
    """Both limits: the cheapest run that meets both, else the one whose worse overshoot is smallest."""
    def hours(r: dict) -> float:
        return margin(_hours(r))

    def cost(r: dict) -> float:
        return margin(_cost(r))

    meets = [r for r in feasible if cost(r) <= budget_usd and hours(r) <= deadline_hours]
    limits = f"the budget of ${budget_usd:,.2f} and the deadline of {deadline_hours:,.2f} h {margin.words}"
    if meets:
        best = min(meets, key=lambda r: (cost(r), hours(r)))
        return best, f"cheapest within {limits}: {_describe(best)}{margin.slow_end(best)}"

    def overshoot(r: dict) -> float:
        return max(cost(r) / budget_usd, hours(r) / deadline_hours) - 1.0

    near = min(feasible, key=lambda r: (overshoot(r), cost(r), hours(r)))
    misses = []
    if cost(near) > budget_usd:
        over = cost(near) - budget_usd
        misses.append(f"${over:,.2f} ({100 * over / budget_usd:.1f}%) over budget")
    if hours(near) > deadline_hours:
        late = hours(near) - deadline_hours
        misses.append(f"{late:,.2f} h ({100 * late / deadline_hours:.1f}%) late")
    return None, f"no composition meets {limits}; the closest, {_describe(near)}, is {' and '.join(misses)}"


# -- what `fasop pareto` computes ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Sweep:
    """A sweep's records (or the integer program's points), `on_front` marked, and the composition that meets the
    budget or deadline best."""

    records: list[dict]
    chosen: dict | None  # one of `records`; None without a budget or deadline, or when no composition meets it
    choice: str  # the line that says which and why ("" without a budget or deadline)
    rent: RentFront | None = None  # the walk that found the records, when the integer program chose them


def _check_choice(budget_usd: float | None, deadline_hours: float | None, margin: float | None,
                  train_steps: int | None, train_tokens: float | None) -> None:
    """A budget or a deadline needs the length of the run: the default length would decide which composition
    meets it."""
    check_limits(budget_usd, deadline_hours)
    check_margin(margin)
    if (budget_usd is not None or deadline_hours is not None) and train_steps is None and train_tokens is None:
        raise ArgumentError("budget_usd" if budget_usd is not None else "deadline_hours",
                            "a budget or deadline needs the length of the run: give train_steps or train_tokens")


def sweep_and_choose(model: Model, cluster: Cluster, compositions: list[dict[str, int]] | None = None, *,
                     budget_usd: float | None = None, deadline_hours: float | None = None,
                     margin: float | None = None, gbs: int | None = None,
                     train_steps: int | None = None, train_tokens: float | None = None, profiles_dir: str | None = None,
                     distributed_optimizer: bool = True, allow_profile_mismatch: bool = False,
                     progress: Callable[[int, int], None] | None = None, profiles: dict | None = None,
                     spaces: list | None = None, space_profiles: list[dict | None] | None = None) -> Sweep:
    """`sweep` of `compositions`, then `choose` within `budget_usd` and `deadline_hours` with `margin`. With
    `spaces` (fasop.search.precision.precision_spaces; their profiles in `space_profiles`, else read), a sweep
    in each precision, each composition taking its fastest plan of any (best_of_precisions)."""
    _check_choice(budget_usd, deadline_hours, margin, train_steps, train_tokens)
    options: dict[str, Any] = dict(gbs=gbs, train_steps=train_steps, train_tokens=train_tokens,
                                   profiles_dir=profiles_dir, distributed_optimizer=distributed_optimizer,
                                   allow_profile_mismatch=allow_profile_mismatch, progress=progress)
    if spaces:
        sweeps = [sweep(space.model, cluster, compositions, profiles=space_profile, left_out=space.left_out, **options)
                  for space, space_profile in zip(spaces, space_profiles or [None for _ in spaces])]
        records = sweeps[0] if len(sweeps) == 1 else best_of_precisions(sweeps, [s.model.precision for s in spaces])
    else:
        records = sweep(model, cluster, compositions, profiles=profiles, **options)
    chosen, choice = choose(records, budget_usd, deadline_hours, margin, cluster.error_band)
    return Sweep(records, chosen, choice)


def rent_and_choose(model: Model, cluster: Cluster, *, max_nodes: dict[str, int] | None = None,
                    budget_usd: float | None = None, deadline_hours: float | None = None, margin: float | None = None,
                    gbs: int | None = None, train_steps: int | None = None, train_tokens: float | None = None,
                    profiles_dir: str | None = None, distributed_optimizer: bool = True,
                    allow_profile_mismatch: bool = False, profiles: dict | None = None,
                    time_limit_s: float = RENT_TIME_LIMIT_S, max_points: int = MAX_POINTS) -> Sweep:
    """`rent_front` (fasop.market.rent: the integer program chooses node counts up to each type's quota), then
    `choose` from its points within `budget_usd` and `deadline_hours` with `margin`."""
    _check_choice(budget_usd, deadline_hours, margin, train_steps, train_tokens)
    walk = rent_front(model, cluster, max_nodes=max_nodes, gbs=gbs, train_steps=train_steps, train_tokens=train_tokens,
                      profiles_dir=profiles_dir, distributed_optimizer=distributed_optimizer,
                      allow_profile_mismatch=allow_profile_mismatch, profiles=profiles, time_limit_s=time_limit_s,
                      max_points=max_points)
    chosen, choice = choose(walk.records, budget_usd, deadline_hours, margin, cluster.error_band)
    return Sweep(walk.records, chosen, choice, walk)


def pareto(model: Model, cluster: Cluster, *, max_nodes: dict[str, int] | None = None, gbs: int | None = None,
           train_steps: int | None = None, train_tokens: float | None = None, budget_usd: float | None = None,
           deadline_hours: float | None = None, margin: float | None = None, profiles_dir: str | None = None,
           distributed_optimizer: bool = True, allow_profile_mismatch: bool = False, rent: bool = False,
           time_limit_s: float = RENT_TIME_LIMIT_S, precisions: tuple[str, ...] | None = None,
           fp8_recipe: str | None = None, fp8_param_gather: bool | None = None):
    """`fasop pareto` in Python: every composition of `cluster` (at most `max_nodes` nodes of a type, {"A100": 4})
    with its fastest plan and the time and cost of the run, as a pandas DataFrame of one row per composition in
    sweep order, in the columns of a front file (docs/formats.md); `on_front` marks the Pareto front. With
    `rent` (`fasop pareto --rent`), one row per point the integer program finds within `time_limit_s`, each node
    type's count read as its quota (fasop.market.rent), cheapest per hour first; `frame.attrs["complete"]` says
    whether the walk reached its end. `precisions` (("bf16", "fp8")): a sweep in each, each composition with its
    fastest plan of any (fp8 on the node types whose GPUs run `fp8_recipe`; fasop.search.precision).

    Node counts and the other integer columns are pandas' nullable Int64 (<NA> where a composition has no plan,
    like the front file's empty cells). `frame.attrs`: `chosen`, the row of the composition that meets
    `budget_usd` / `deadline_hours` best with `margin` (`choose`; None without either, or when none meets them),
    and `choice`, the line
    `fasop pareto` prints about it.
    """
    import pandas as pd  # only the Python API needs pandas; the command line starts faster without it

    common: dict[str, Any] = dict(budget_usd=budget_usd, deadline_hours=deadline_hours, margin=margin, gbs=gbs,
                                  train_steps=train_steps, train_tokens=train_tokens, profiles_dir=profiles_dir,
                                  distributed_optimizer=distributed_optimizer,
                                  allow_profile_mismatch=allow_profile_mismatch)
    if rent:
        if precisions or fp8_recipe or fp8_param_gather:
            raise ArgumentError("precisions", "sweeps compositions; rent plans in the model file's precision")
        result = rent_and_choose(model, cluster, max_nodes=max_nodes, time_limit_s=time_limit_s, **common)
    else:
        spaces = None
        if precisions or fp8_recipe or fp8_param_gather:
            from fasop.search.precision import precision_spaces

            spaces = precision_spaces(model, cluster, precisions, fp8_recipe, fp8_param_gather,
                                      distributed_optimizer=distributed_optimizer)
        result = sweep_and_choose(model, cluster, compositions(cluster, max_nodes), spaces=spaces, **common)
    frame = pd.DataFrame(result.records)
    frame = frame.astype({column: "Int64" for column in frame.columns
                          if column in INT_COLUMNS or column.startswith(NODES_PREFIX)})
    frame.attrs.update(chosen=next((row for row, record in enumerate(result.records) if record is result.chosen), None),
                       choice=result.choice)
    if result.rent is not None:
        frame.attrs["complete"] = result.rent.complete
    return frame
