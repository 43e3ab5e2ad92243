"""Plan files: what `fasop search --output` writes (JSON or CSV) and what `fasop emit` and `fasop plot` read."""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fasop.errors import InputError
from fasop.files import PLANS_LIMIT_BYTES, check_finite, read_json, write_atomically

MAX_PLAN_INT = 2**53  # ranks, degrees, batch sizes and layer counts of a plan file: exact in any JSON reader
PLAN_KEYS = ("rank", "gbs", "mbs", "tp", "dp", "pp", "placement", "layers_per_stage")  # what readers rely on
PLAN_KINDS = ("3d", "ddp", "zero1", "zero2", "zero3")  # `kind` of a plan; plans without one are 3d
CSV_LISTS = ("placement", "layers_per_stage")
# Joins the items of a list in one CSV cell: a space is outside the character set of names (fasop.inputs.names),
# so every node-type name reads back whole ("-" is inside it).
CSV_LIST_SEPARATOR = " "


@dataclass(frozen=True)
class PlanShape:
    """What makes a plan, checked: degrees, batch sizes, placement and layers per stage (what launching or
    re-estimating a plan needs of a plan file)."""

    tp: int
    dp: int
    pp: int
    mbs: int
    gbs: int
    placement: tuple[str, ...]
    layers_per_stage: tuple[int, ...]
    distributed_optimizer: bool


def placement_runs(placement: Sequence[str]) -> list[tuple[str, int]]:
    """Runs of consecutive nodes of one type, in placement order: [A10, A100, A100, A10] -> 3 runs."""
    return [(name, len(list(run))) for name, run in itertools.groupby(placement)]


def compress_placement(placement: Sequence) -> str:
    """['A100', 'A10', 'A10'] -> 'A100,A10*2' (runs of one node type; numbers are joined as they are)."""
    return ",".join(str(name) if count == 1 else f"{name}*{count}" for name, count in placement_runs(placement))


def plans_as_json(plans: list[dict]) -> str:
    return json.dumps(plans, indent=1, allow_nan=False) + "\n"


def plans_as_csv(plans: list[dict]) -> str:
    """The same columns as the JSON; lists joined with spaces, the per-stage breakdown as compact JSON."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(plans[0]), lineterminator="\n")
    writer.writeheader()
    for plan in plans:
        flat = dict(plan)
        for key in CSV_LISTS:
            flat[key] = CSV_LIST_SEPARATOR.join(map(str, plan[key]))
        flat["stages"] = json.dumps(plan["stages"], separators=(",", ":"))
        writer.writerow(flat)
    return out.getvalue()


def plans_text(plans: list[dict], output: Path) -> str:
    """What write_plans writes to `output` (.json or .csv); refuses non-finite numbers before anything is written."""
    if output.suffix not in (".json", ".csv"):
        raise InputError(f"--output {output}", "expected a file name ending in .json or .csv")
    check_finite(plans, f"--output {output}")
    return plans_as_json(plans) if output.suffix == ".json" else plans_as_csv(plans)


def write_plans(plans: list[dict], output: Path) -> None:
    write_atomically(output, plans_text(plans, output), f"--output {output}")


def _check_plan_fields(plan: dict, where: str) -> None:
    """The keys readers rely on hold what fasop search writes; every number in the plan is finite."""
    for key in ("rank", "gbs", "mbs", "tp", "dp", "pp"):
        value = plan[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PLAN_INT:
            raise InputError(f"{where}: {key}", f"expected an integer from 1 to {MAX_PLAN_INT:,}, got {value!r}")
    placement, layers = plan["placement"], plan["layers_per_stage"]
    if not isinstance(placement, list) or not placement or not all(isinstance(n, str) and n for n in placement):
        raise InputError(f"{where}: placement", "expected a non-empty list of node-type names")
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_PLAN_INT for n in layers)):
        raise InputError(f"{where}: layers_per_stage", "expected a non-empty list of layer counts (integers >= 0)")
    if plan.get("kind", "3d") not in PLAN_KINDS:
        raise InputError(f"{where}: kind", f"expected one of {', '.join(PLAN_KINDS)}, got {plan['kind']!r}")
    check_finite(plan, where)


def load_plans(path: str | os.PathLike) -> list[dict]:
    """The plan list written by `fasop search --output plans.json`, checked to be one."""
    where = str(path)
    if str(path).endswith(".csv"):
        raise InputError(where, "expected the JSON plan list written by fasop search --output plans.json, not CSV")
    data = read_json(path, PLANS_LIMIT_BYTES, "a fasop plan list", missing="no such plan file")
    if not isinstance(data, list) or not data:
        raise InputError(where, "not a fasop plan list: expected a non-empty JSON list of plan objects")
    for index, plan in enumerate(data):
        if not isinstance(plan, dict):
            raise InputError(where, f"not a fasop plan list: entry {index} is not an object")
        missing = [key for key in PLAN_KEYS if key not in plan]
        if missing:
            raise InputError(where, f"not a fasop plan list: entry {index} lacks {', '.join(missing)}")
        _check_plan_fields(plan, f"{where}: entry {index}")
    return data


def select_plan(plans: Sequence[dict], rank: int, where: str) -> dict:
    """The plan whose `rank` is `rank` (1 = best)."""
    for plan in plans:
        if plan.get("rank") == rank:
            return plan
    ranks = sorted(p["rank"] for p in plans if isinstance(p.get("rank"), int))
    held = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no ranks"
    raise InputError(f"--rank {rank}", f"no such plan in {where} (it holds {len(plans)} plans, {held})")
