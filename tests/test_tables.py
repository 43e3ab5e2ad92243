"""The ranked table of `fasop search`: plans that differ only in placement collapsed into the best-ranked one,
tokens per second, memory as used of capacity; `--all-placements` lists every plan."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_cli_search import invoke, ok, table_lines

from fasop.cli.tables import format_table
from fasop.plans import Plan, compress_placement

GPT2_XL = ["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-7xA10"]
COLUMNS = ("rank", "mbs", "tp", "dp", "pp", "vp", "recompute", "sp", "placement", "layers", "plans", "step",
           "samples", "tokens", "memory", "cost")


def rows(stdout: str) -> list[dict[str, str]]:
    """The table's rows by column (no cell holds a space); without a `plans` column under --all-placements."""
    header, lines = table_lines(stdout)
    names = COLUMNS if "plans" in header.split() else tuple(c for c in COLUMNS if c != "plans")
    return [dict(zip(names, line.split(), strict=True)) for line in lines]


def shown(plan: dict) -> dict[str, str]:
    """The cells of a plan-file record as the table prints them (but rank, placement, layers and plans)."""
    return {"mbs": str(plan["mbs"]), "tp": str(plan["tp"]), "dp": str(plan["dp"]), "pp": str(plan["pp"]),
            "vp": str(plan.get("virtual_stages") or 1), "recompute": plan.get("recompute") or "none",
            "sp": "on" if plan.get("sequence_parallel") else "-", "step": f"{plan['step_time_s']:.4f}",
            "samples": f"{plan['throughput_samples_per_s']:.1f}", "tokens": f"{plan['tokens_per_s']:,.0f}",
            "memory": f"{plan['peak_memory_gib']:.1f}/{plan['memory_capacity_gib']:.1f}",
            "cost": f"{plan['cost_per_step_usd']:.5f}"}


def same_up_to_placement(a: dict, b: dict) -> bool:
    return shown(a) == shown(b) and sorted(a["layers_per_stage"]) == sorted(b["layers_per_stage"])


@pytest.fixture(scope="module")
def gpt2_xl(tmp_path_factory):
    """The README's search: its default table, its table of every placement, and the plan file."""
    out = tmp_path_factory.mktemp("gpt2-xl") / "plans.json"
    runner = CliRunner()
    default = invoke(runner, [*GPT2_XL, "--output", out])
    every = invoke(runner, [*GPT2_XL, "--all-placements"])
    ok(default)
    ok(every)
    return rows(default.stdout), rows(every.stdout), json.loads(out.read_text())


def test_rows_are_distinct_plans(gpt2_xl):
    table, _, _ = gpt2_xl
    assert len(table) == 10
    figures = [tuple(v for k, v in row.items() if k not in ("rank", "placement", "layers", "plans")) for row in table]
    assert len(set(figures)) == len(figures)
    assert any(int(row["plans"]) > 1 for row in table), "the example has rotations to collapse"


def test_each_row_is_its_plan_and_counts_the_plans_it_stands_for(gpt2_xl):
    table, _, plans = gpt2_xl
    for row in table:
        plan = plans[int(row["rank"]) - 1]  # the rank is the plan file's: `fasop emit --rank` names this row
        assert plan["rank"] == int(row["rank"])
        assert row["placement"] == compress_placement(plan["placement"])
        assert row["layers"] == ",".join(map(str, plan["layers_per_stage"]))
        assert {k: row[k] for k in shown(plan)} == shown(plan)
        group = [p["rank"] for p in plans if same_up_to_placement(p, plan)]
        assert int(row["plans"]) == len(group) and min(group) == plan["rank"]


def test_no_plan_is_left_out_that_is_not_counted(gpt2_xl):
    """Every plan ranked above the last row is in the table or stands behind a better-ranked row."""
    table, _, plans = gpt2_xl
    heads = [plans[int(row["rank"]) - 1] for row in table]
    for plan in plans[:int(table[-1]["rank"])]:
        head = next(h for h in heads if same_up_to_placement(h, plan))
        assert head["rank"] <= plan["rank"]


def test_all_placements_lists_every_top_plan(gpt2_xl):
    _, every, plans = gpt2_xl
    assert [int(row["rank"]) for row in every] == list(range(1, 11))
    for row, plan in zip(every, plans):
        assert row["placement"] == compress_placement(plan["placement"])
        assert {k: row[k] for k in shown(plan)} == shown(plan)
    assert len({tuple(shown(p).values()) for p in plans[:10]}) < 10, "the top 10 hold rotations of one plan"


def test_tokens_per_second_and_memory_of_capacity(gpt2_xl):
    table, _, plans = gpt2_xl
    for row in table:
        plan = plans[int(row["rank"]) - 1]
        assert float(row["tokens"].replace(",", "")) == pytest.approx(plan["tokens_per_s"], abs=0.5)
        used, capacity = map(float, row["memory"].split("/"))
        assert used == pytest.approx(plan["peak_memory_gib"], abs=0.05)
        assert capacity == pytest.approx(plan["memory_capacity_gib"], abs=0.05) and used <= capacity


def test_only_placement_and_layer_order_may_differ(gpt2_xl):
    """A rotation with its layers in another order is collapsed; other layers, or another figure, are not."""
    _, _, plans = gpt2_xl
    best = plans[0]
    rotated = {**best, "rank": 2, "placement": best["placement"][::-1], "layers_per_stage": best["layers_per_stage"][::-1]}
    layers = list(best["layers_per_stage"])
    layers[0], layers[-1] = layers[0] + 1, layers[-1] - 1
    other_split = {**best, "rank": 3, "layers_per_stage": layers}
    fuller = {**best, "rank": 4, "peak_memory_gib": best["peak_memory_gib"] + 0.1}
    table = format_table([Plan.trusted(p) for p in (best, rotated, other_split, fuller)], top=10)
    lines = table.splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["1", "3", "4"]
    assert [line.split()[10] for line in lines] == ["2", "1", "1"]
