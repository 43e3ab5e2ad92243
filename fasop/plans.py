"""Plan files: what `fasop search --output` writes (JSON or CSV) and what `fasop emit` and `fasop plot` read."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Sequence

from fasop.errors import InputError
from fasop.files import write_atomically

PLAN_KEYS = ("rank", "gbs", "mbs", "tp", "dp", "pp", "placement", "layers_per_stage")  # what readers rely on
CSV_LISTS = ("placement", "layers_per_stage")
# Joins the items of a list in one CSV cell: a space is outside the character set of names (fasop.names),
# so every node-type name reads back whole ("-" is inside it).
CSV_LIST_SEPARATOR = " "


def plans_as_json(plans: list[dict]) -> str:
    return json.dumps(plans, indent=1) + "\n"


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


def write_plans(plans: list[dict], output: Path) -> None:
    if output.suffix == ".json":
        write_atomically(output, plans_as_json(plans))
    elif output.suffix == ".csv":
        write_atomically(output, plans_as_csv(plans))
    else:
        raise InputError(f"--output {output}", "expected a file name ending in .json or .csv")


def load_plans(path: str | os.PathLike) -> list[dict]:
    """The plan list written by `fasop search --output plans.json`, checked to be one."""
    where = str(path)
    if str(path).endswith(".csv"):
        raise InputError(where, "expected the JSON plan list written by fasop search --output plans.json, not CSV")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(where, "no such plan file") from None
    except IsADirectoryError:
        raise InputError(where, "is a directory, expected a plan file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(where, f"cannot read ({err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(where, f"not a fasop plan list: not JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, list) or not data:
        raise InputError(where, "not a fasop plan list: expected a non-empty JSON list of plan objects")
    for index, plan in enumerate(data):
        if not isinstance(plan, dict):
            raise InputError(where, f"not a fasop plan list: entry {index} is not an object")
        missing = [key for key in PLAN_KEYS if key not in plan]
        if missing:
            raise InputError(where, f"not a fasop plan list: entry {index} lacks {', '.join(missing)}")
    return data


def select_plan(plans: Sequence[dict], rank: int, where: str) -> dict:
    """The plan whose `rank` is `rank` (1 = best)."""
    for plan in plans:
        if plan.get("rank") == rank:
            return plan
    ranks = sorted(p["rank"] for p in plans if isinstance(p.get("rank"), int))
    held = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no ranks"
    raise InputError(f"--rank {rank}", f"no such plan in {where} (it holds {len(plans)} plans, {held})")
