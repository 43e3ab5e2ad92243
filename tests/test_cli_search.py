"""`fasop search` and `fasop estimate` through the command line: ranked table, output files, the
estimate breakdown, optimality of the chosen layer split, and every bad input of issue 2 item 6."""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import TINY_MODEL, model_toml, profile_csv, without_optimizer_step

from fasop.cli import main
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.plans import Plan
from fasop.search import estimate, search_plans

REQUIRED_KEYS = ("mbs", "tp", "dp", "pp", "placement", "layers_per_stage", "step_time_s",
                 "throughput_samples_per_s", "peak_memory_gib", "cost_per_step_usd")
BERT_ARGS = ["--model", "bert", "--cluster", "fasop-1xA100-3xA10"]
BERT_PLAN = ["--tp", "1", "--dp", "4", "--pp", "4", "--mbs", "8", "--placement", "A100,A10,A10,A10", "--layers", "12,5,5,2"]


# -- helpers -----------------------------------------------------------------------------------------------
def ok(result) -> None:
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"


def invoke(runner: CliRunner, args: list[str]):
    return runner.invoke(main, [str(a) for a in args])


def table_lines(stdout: str) -> tuple[str, list[str]]:
    """The ranked table's header line and its rows (the lines after the header that start with a rank)."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rank"])
    rows = []
    for line in lines[at + 1:]:
        if not re.match(r"^\s*\d+(\s+\d+){4}\s", line):  # rank, mbs, tp, dp, pp
            break
        rows.append(line)
    return lines[at], rows


def assert_input_error(result, *names: str, output: Path | None = None) -> str:
    """One line on stderr, `Error: ...` naming each of `names`, exit code 2, no traceback, no output file."""
    everything = result.output + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"uncaught {result.exception!r}\n{everything}")
    assert result.exit_code == 2, f"exit {result.exit_code}\n{everything}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    line = lines[0]
    assert line.startswith("Error:"), line
    for name in names:
        assert name in line, f"{name!r} not named in: {line}"
    assert "Traceback" not in everything
    if output is not None:
        assert not output.exists(), f"{output} written despite the error"
        leftovers = [p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}")]
        assert not leftovers, f"partial files left: {leftovers}"
    return line


@contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError in the test if the block runs longer than `seconds` (a hang is a failure too)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def splits(total: int, pp: int):
    """Every layer split of a decoder model: the first and last stage may be empty (embedding or head only)."""
    if pp == 1:
        yield (total,)
        return
    lo = [0] + [1] * (pp - 2) + [0]
    for head in itertools.product(*(range(low, total + 1) for low in lo[:-1])):
        rest = total - sum(head)
        if rest >= lo[-1]:
            yield head + (rest,)


# -- search on a bundled FASOP experiment --------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_search(tmp_path_factory):
    """bert on fasop-1xA100-3xA10, written as JSON (twice) and CSV."""
    folder = tmp_path_factory.mktemp("bert")
    runner = CliRunner()
    results = {}
    for name in ("plans.json", "again.json", "plans.csv", "again.csv"):
        result = runner.invoke(main, ["search", *BERT_ARGS, "--top", "5", "--output", str(folder / name)])
        ok(result)
        results[name] = result
    return folder, results


def test_bundled_search_prints_ranked_table(bert_search):
    folder, results = bert_search
    header, rows = table_lines(results["plans.json"].stdout)
    lowered = header.lower()
    for column in ("mbs", "tp", "dp", "pp", "vp", "placement", "layers", "plans", "step", "tokens/s", "used/cap",
                   "$/step"):
        assert column in lowered, f"{column!r} missing from {header!r}"
    assert "step s: Megatron-LM's 1F1B schedule timed exactly" in results["plans.json"].stdout
    assert "throughput" in lowered or "samples/s" in lowered
    plans = json.loads((folder / "plans.json").read_text())
    assert 1 <= len(rows) <= 5 and len(rows) == min(5, len(plans))
    assert [int(r.split()[0]) for r in rows] == list(range(1, len(rows) + 1))
    assert f"{plans[0]['step_time_s']:.4f}" in rows[0]


def test_bundled_search_top_limits_rows(runner):
    result = invoke(runner, ["search", *BERT_ARGS, "--top", "2"])
    ok(result)
    assert len(table_lines(result.stdout)[1]) == 2
    result = invoke(runner, ["search", *BERT_ARGS])
    ok(result)
    assert len(table_lines(result.stdout)[1]) == 10  # the default


@pytest.mark.parametrize("options", [[], ["--sort", "cost"], ["--all-placements"], ["--top", "30"]])
def test_the_pruned_table_is_the_full_searchs(runner, tmp_path, options):
    """By default the search solves only what can reach the table's rows; the rows, and the plans each stands for
    (six placements of one plan here), are those of the search of every plan; --output asks for every plan."""
    args = ["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-7xA10", "--top", "5", *options]
    pruned, full = invoke(runner, args), invoke(runner, [*args, "--no-prune"])
    ok(pruned)
    ok(full)
    assert table_lines(pruned.stdout) == table_lines(full.stdout)
    assert "best kept" in pruned.stdout and "fit in memory" in full.stdout
    if not options:
        assert any(row.split()[-6] == "6" for row in table_lines(pruned.stdout)[1])
    written = invoke(runner, [*args, "--output", tmp_path / "plans.json"])
    ok(written)
    assert "fit in memory" in written.stdout and table_lines(written.stdout) == table_lines(full.stdout)


def test_bundled_search_json(bert_search):
    folder, _ = bert_search
    plans = json.loads((folder / "plans.json").read_text())
    assert isinstance(plans, list) and plans
    cluster, model = load_cluster("fasop-1xA100-3xA10"), load_model("bert")
    times = [p["step_time_s"] for p in plans]
    assert times == sorted(times)
    for plan in plans:
        assert set(REQUIRED_KEYS) <= set(plan)
        # every node of each node type it uses (plans may leave whole node types idle)
        assert set(plan["placement"]) <= set(cluster.node_types)
        for name in set(plan["placement"]):
            assert plan["placement"].count(name) == cluster.node_types[name].count
        assert plan["tp"] * plan["dp"] * plan["pp"] == len(plan["placement"]) * cluster.gpus_per_node
        assert len(plan["layers_per_stage"]) == plan["pp"]
        assert sum(plan["layers_per_stage"]) == model.num_layers
        assert plan["peak_memory_gib"] * cluster.memory_margin <= plan["memory_capacity_gib"] * (1 + 1e-12)
        for stage in plan["stages"]:
            memory = min(cluster.node_types[plan["placement"][n]].gpu_memory_gib for n in stage["nodes"])
            assert stage["memory_gib"] * cluster.memory_margin <= memory * (1 + 1e-12)


def test_bundled_search_csv_has_the_json_columns(bert_search):
    folder, _ = bert_search
    plans = json.loads((folder / "plans.json").read_text())
    with open(folder / "plans.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    # every field any plan has, in the order plan files write them
    assert reader.fieldnames == [name for name in Plan.model_fields if any(name in plan for plan in plans)]
    assert set(REQUIRED_KEYS) <= set(reader.fieldnames)
    assert len(rows) == len(plans)
    for row, plan in zip(rows, plans):
        assert row["placement"].split(" ") == plan["placement"]
        assert row["layers_per_stage"] == " ".join(map(str, plan["layers_per_stage"]))
        assert float(row["step_time_s"]) == plan["step_time_s"]
        assert int(row["tp"]) == plan["tp"] and int(row["mbs"]) == plan["mbs"]


def test_bundled_search_is_deterministic(bert_search):
    folder, results = bert_search
    assert (folder / "plans.json").read_bytes() == (folder / "again.json").read_bytes()
    assert (folder / "plans.csv").read_bytes() == (folder / "again.csv").read_bytes()
    assert results["plans.json"].stdout.count("\n") == results["again.json"].stdout.count("\n")


def test_bundled_search_removes_out_of_memory_plans(tmp_path, runner):
    """gpt2-xl on the A100+A10 cluster has plans that do not fit without recomputation: none of them reaches the
    output."""
    output = tmp_path / "plans.json"
    result = invoke(runner, ["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-3xA10", "--output", output,
                             "--recompute", "none"])
    ok(result)
    removed = re.search(r"(\d+) removed as out of memory", result.stdout)
    assert removed and int(removed.group(1)) > 0
    cluster = load_cluster("fasop-1xA100-3xA10")
    for plan in json.loads(output.read_text()):
        for stage in plan["stages"]:
            memory = min(cluster.node_types[plan["placement"][n]].gpu_memory_gib for n in stage["nodes"])
            assert stage["memory_gib"] * cluster.memory_margin + cluster.gpu_memory_overhead_gib <= memory * (1 + 1e-12)


# -- search on the tiny inputs -------------------------------------------------------------------------------
def tiny_plans(runner, setup, *extra: str) -> list[dict]:
    output = setup.root / "plans.json"
    result = invoke(runner, ["search", *setup.args(*extra), "--output", output, "--force"])
    ok(result)
    return json.loads(output.read_text())


def test_tiny_search_out_of_memory_plans_are_removed(runner, tiny):
    setup = tiny(nodes={"fast": {"gpu_memory_gib": 0.0029}, "slow": {"gpu_memory_gib": 0.0029}})
    output = setup.root / "plans.json"
    result = invoke(runner, ["search", *setup.args("--output", output)])
    ok(result)
    removed = re.search(r"(\d+) removed as out of memory", result.stdout)
    assert removed and int(removed.group(1)) > 0
    plans = json.loads(output.read_text())
    assert plans
    for plan in plans:
        assert plan["peak_memory_gib"] * 1.1 <= 0.0029 * (1 + 1e-12)
        assert all(s["memory_gib"] * 1.1 <= 0.0029 * (1 + 1e-12) for s in plan["stages"])


def test_train_steps_adds_run_hours_and_cost(runner, tiny):
    setup = tiny()
    result = invoke(runner, ["search", *setup.args("--train-steps", "1000")])
    ok(result)
    header, _ = table_lines(result.stdout)
    assert len(header.split()) > len(table_lines(invoke(runner, ["search", *setup.args()]).stdout)[0].split())
    for plan in tiny_plans(runner, setup, "--train-steps", "1000"):
        assert plan["train_steps"] == 1000
        assert plan["train_cost_usd"] == pytest.approx(1000 * plan["cost_per_step_usd"], rel=1e-12)
        assert plan["train_hours"] == pytest.approx(1000 * plan["step_time_s"] / 3600, rel=1e-12)


@pytest.mark.parametrize("tokens", ["1000", "2560001", "256000"])
def test_train_tokens_gives_steps(runner, tiny, tokens):
    setup = tiny()
    steps = math.ceil(int(tokens) / (TINY_MODEL["global_batch_size"] * TINY_MODEL["seq_length"]))
    for plan in tiny_plans(runner, setup, "--train-tokens", tokens):
        assert plan["train_steps"] == steps
        assert plan["train_cost_usd"] == pytest.approx(steps * plan["cost_per_step_usd"], rel=1e-12)


def test_without_a_run_there_are_no_run_columns(runner, tiny):
    for plan in tiny_plans(runner, tiny()):
        assert "train_cost_usd" not in plan and "train_hours" not in plan


def test_sort_by_cost(runner, tiny):
    setup = tiny()
    by_cost = tiny_plans(runner, setup, "--sort", "cost")
    costs = [p["cost_per_step_usd"] for p in by_cost]
    assert costs == sorted(costs)
    by_time = tiny_plans(runner, setup)

    def unranked(plans):
        return sorted(json.dumps({k: v for k, v in p.items() if k != "rank"}, sort_keys=True) for p in plans)

    assert unranked(by_time) == unranked(by_cost)  # the same plans, in another order


def test_gbs_option_overrides_the_model(runner, tiny):
    plans = tiny_plans(runner, tiny(), "--gbs", "4")
    assert {p["gbs"] for p in plans} == {4}
    assert all(4 % (p["dp"] * p["mbs"]) == 0 for p in plans)


# -- estimate ------------------------------------------------------------------------------------------------
def test_estimate_json_matches_the_search_row(runner, bert_search):
    folder, _ = bert_search
    result = invoke(runner, ["estimate", *BERT_ARGS, *BERT_PLAN, "--json"])
    ok(result)
    row = json.loads(result.stdout)
    assert set(REQUIRED_KEYS) | {"stages"} <= set(row)
    plans = json.loads((folder / "plans.json").read_text())
    assert set(plans[0]) - {"rank"} <= set(row)
    assert len(row["stages"]) == 4
    for stage in row["stages"]:
        assert {"compute_s", "p2p_s", "dp_allreduce_s", "memory_gib"} <= set(stage)
    assert row["placement"] == ["A100", "A10", "A10", "A10"] and row["layers_per_stage"] == [12, 5, 5, 2]
    same = [p for p in plans if (p["tp"], p["dp"], p["pp"], p["mbs"], p["placement"], p["layers_per_stage"])
            == (1, 4, 4, 8, ["A100", "A10", "A10", "A10"], [12, 5, 5, 2])]
    assert len(same) == 1, "the search should list this plan with this layer split"
    assert row["step_time_s"] == pytest.approx(same[0]["step_time_s"], rel=1e-9)
    assert row["cost_per_step_usd"] == pytest.approx(same[0]["cost_per_step_usd"], rel=1e-9)
    assert row["peak_memory_gib"] == pytest.approx(same[0]["peak_memory_gib"], rel=1e-9)
    for ours, theirs in zip(row["stages"], same[0]["stages"]):
        for key in ("compute_s", "p2p_s", "dp_allreduce_s", "memory_gib"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-9), key


def test_estimate_text_prints_a_stage_table(runner):
    result = invoke(runner, ["estimate", *BERT_ARGS, *BERT_PLAN])
    ok(result)
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["stage"])
    stages = lines[at + 1:at + 5]
    assert [line.split()[0] for line in stages] == ["0", "1", "2", "3"]
    assert [line.split()[1] for line in stages] == ["A100", "A10", "A10", "A10"]
    assert [int(line.split()[2]) for line in stages] == [12, 5, 5, 2]
    assert "step time" in result.stdout
    assert result.stderr == ""


def test_estimate_of_a_plan_over_memory_exits_3(runner):
    """The breakdown all the same (text or JSON), then one line on stderr naming the stage over its usable memory
    and status 3 (bad input is 2). Stage 1 (A10) is over; stage 0 (A100) holds more, and fits."""
    plan = ["--tp", "1", "--dp", "4", "--pp", "4", "--mbs", "16", "--placement", "A100,A10*3", "--layers", "11,11,1,1"]
    text, as_json = (invoke(runner, ["estimate", *BERT_ARGS, *plan, *extra]) for extra in ([], ["--json"]))
    cluster = load_cluster("fasop-1xA100-3xA10")

    def usable(stage: dict) -> float:
        return (stage["memory_capacity_gib"] - cluster.gpu_memory_overhead_gib) / cluster.memory_margin

    row = json.loads(as_json.stdout)
    assert row["fits_memory"] is False
    first, over = row["stages"][:2]
    assert usable(first) >= first["memory_gib"] > over["memory_gib"] > usable(over)
    assert "(does NOT fit with margin 1.1)" in text.stdout and "price" in text.stdout
    said = (f"Error: the plan does not fit GPU memory: stage 1 (A10) peaks at {over['memory_gib']:.2f} GiB, "
            f"{usable(over):.2f} GiB usable of {over['memory_capacity_gib']:.2f} GiB (less "
            f"{cluster.gpu_memory_overhead_gib:g} GiB overhead, over memory margin {cluster.memory_margin:g})")
    for result in (text, as_json):
        assert result.exit_code == 3, result.output
        assert result.stderr.splitlines() == [said]


def test_best_tiny_plan_beats_every_other_layer_split(runner, tiny):
    """The search's best plan against `fasop estimate` of every split of its (tp, dp, pp, mbs, placement)."""
    setup = tiny()
    best = tiny_plans(runner, setup)[0]
    assert best["pp"] > 1, "the tiny case should exercise a pipeline"
    plan = ["--tp", best["tp"], "--dp", best["dp"], "--pp", best["pp"], "--mbs", best["mbs"],
            "--placement", ",".join(best["placement"]), "--virtual-stages", best["virtual_stages"]]
    tried = 0
    for split in splits(TINY_MODEL["num_layers"], best["pp"]):
        result = invoke(runner, ["estimate", *setup.args(*map(str, plan)), "--layers", ",".join(map(str, split)), "--json"])
        ok(result)
        row = json.loads(result.stdout)
        tried += 1
        if row["fits_memory"]:  # the split is the best for the closed form it optimises (docs/cost-model.md 4.2)
            assert best["closed_form_step_s"] <= row["closed_form_step_s"] * (1 + 1e-9), split
        if list(split) == best["layers_per_stage"]:
            assert row["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-9)
    assert tried > 1


def test_every_tiny_plan_has_its_best_layer_split(tiny):
    """Every row of the search, not only the best, against the Python estimate of each other split. The
    partition is exact for the closed form, which charges each stage its whole optimizer step; without that
    step, the closed form's best split is the exact schedule's too."""
    setup = tiny(nodes={"slow": {"gpu_memory_gib": 0.0025}})  # some splits do not fit on the slow node
    model = load_model(str(setup.model))
    cluster = without_optimizer_step(load_cluster(str(setup.cluster)))
    plans = [plan.model_dump() for plan in search_plans(model, cluster, profiles_dir=str(setup.profiles)).plans]
    checked = 0
    for plan in plans:
        if plan["pp"] == 1:
            continue
        for split in splits(model.num_layers, plan["pp"]):
            row = estimate(model, cluster, tp=plan["tp"], dp=plan["dp"], pp=plan["pp"], mbs=plan["mbs"],
                           placement=plan["placement"], layers_per_stage=list(split), profiles_dir=str(setup.profiles))
            if row.fits_memory:
                assert plan["step_time_s"] <= row.step_time_s * (1 + 1e-9), (plan["layers_per_stage"], split)
                checked += 1
    assert checked > 20


# -- bad input -------------------------------------------------------------------------------------------------
def search_error(runner, setup, *extra: str):
    output = setup.root / "plans.json"
    result = invoke(runner, ["search", *setup.args(*extra), "--output", output])
    return result, output


TINY_PLAN = ["--tp", "1", "--dp", "1", "--pp", "4", "--mbs", "1", "--placement", "fast,slow", "--layers", "1,1,1,1"]


@pytest.mark.parametrize("text", ["[model\nname = 'tiny'\n", "[model]\nname = 'tiny'\nhidden_size = = 64\n"],
                         ids=["header", "value"])
def test_malformed_model_toml(runner, tiny, text):
    setup = tiny(model=text)
    result, output = search_error(runner, setup)
    line = assert_input_error(result, "model.toml", output=output)
    assert "TOML" in line


@pytest.mark.parametrize("overrides,field", [
    ({"hidden_size": None}, "hidden_size"),
    ({"num_layers": None}, "num_layers"),
    ({"global_batch_size": None}, "global_batch_size"),
    ({"hidden_units": 64}, "hidden_units"),
    ({"num_query_groups": 3}, "num_query_groups"),
    ({"num_layers": 0}, "num_layers"),
    ({"num_layers": -2}, "num_layers"),
    ({"num_layers": "4"}, "num_layers"),
    ({"hidden_size": 4.5}, "hidden_size"),
    ({"architecture": "mixture"}, "architecture"),
    ({"precision": "int4"}, "precision"),
    ({"num_attention_heads": 5}, "num_attention_heads"),
], ids=["no-hidden_size", "no-num_layers", "no-gbs", "unknown-field", "query-groups", "zero-layers",
        "negative-layers", "string-layers", "float-hidden", "architecture", "precision", "heads-not-dividing"])
def test_bad_model_field(runner, tiny, overrides, field):
    setup = tiny(model=overrides)
    result, output = search_error(runner, setup)
    assert_input_error(result, "model.toml", field, output=output)


def test_model_without_model_table(runner, tiny):
    setup = tiny(model='[modle]\nname = "tiny"\n')
    result, output = search_error(runner, setup)
    assert_input_error(result, "model.toml", "model", output=output)


@pytest.mark.parametrize("bandwidth", ["40 Gb/s", "40 Gbps", "forty Gbit/s", "40", "0 Gbit/s", "-5 Gbit/s"])
@pytest.mark.parametrize("field", ["inter_node_bandwidth", "intra_node_bandwidth"])
def test_bad_bandwidth(runner, tiny, bandwidth, field):
    setup = tiny(nodes={"slow": {field: bandwidth}})
    result, output = search_error(runner, setup)
    assert_input_error(result, "cluster.toml", field, output=output)




def test_unknown_cluster_table(runner, tiny):
    setup = tiny(cluster_extra='\n[network]\nspeed = "fast"\n')
    result, output = search_error(runner, setup)
    assert_input_error(result, "cluster.toml", "network", output=output)


@pytest.mark.parametrize("field", ["price_per_hour_usd", "gpu", "gpu_memory_gib", "count", "gpus_per_node",
                                   "inter_node_bandwidth"])
def test_node_type_missing_field(runner, tiny, field):
    setup = tiny(nodes={"fast": {field: None}})
    result, output = search_error(runner, setup)
    assert_input_error(result, "cluster.toml", field, output=output)


@pytest.mark.parametrize("overrides,field", [
    ({"fast": {"price_per_hour_usd": -1.0}}, "price_per_hour_usd"),
    ({"fast": {"gpu_memory_gib": 0}}, "gpu_memory_gib"),
    ({"fast": {"count": -1}}, "count"),
    ({"fast": {"colour": "green"}}, "colour"),
], ids=["negative-price", "zero-memory", "negative-count", "unknown-field"])
def test_bad_node_type_field(runner, tiny, overrides, field):
    setup = tiny(nodes=overrides)
    result, output = search_error(runner, setup)
    assert_input_error(result, "cluster.toml", field, output=output)


NON_FINITE = [
    pytest.param({"fast": {"gpu_memory_gib": math.nan}}, {}, "gpu_memory_gib", id="memory-nan"),
    pytest.param({"fast": {"gpu_memory_gib": math.inf}}, {}, "gpu_memory_gib", id="memory-inf"),
    pytest.param({"fast": {"price_per_hour_usd": math.nan}}, {}, "price_per_hour_usd", id="price-nan"),
    pytest.param({"fast": {"price_per_hour_usd": math.inf}}, {}, "price_per_hour_usd", id="price-inf"),
    pytest.param({}, {"memory_margin": math.nan}, "memory_margin", id="margin-nan"),
    pytest.param({}, {"memory_margin": math.inf}, "memory_margin", id="margin-inf"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("nodes,head,field", NON_FINITE)
def test_non_finite_cluster_number(runner, tiny, nodes, head, field):
    setup = tiny(nodes=nodes, cluster=head)
    with time_limit(1.0):
        result, output = search_error(runner, setup)
    assert_input_error(result, "cluster.toml", field, output=output)


def test_cluster_with_zero_nodes(runner, tiny):
    setup = tiny(nodes={"fast": {"count": 0}, "slow": {"count": 0}})
    result, output = search_error(runner, setup)
    assert_input_error(result, "cluster.toml", "count", output=output)


def test_malformed_cluster_toml(runner, tiny):
    setup = tiny(cluster="[cluster]\nname = tiny\n")
    result, output = search_error(runner, setup)
    assert_input_error(result, "cluster.toml", output=output)


def test_profile_missing_for_one_gpu_type(runner, tiny):
    setup = tiny(profiles={"slow": None})
    result, output = search_error(runner, setup)
    assert_input_error(result, "slow.csv", output=output)


@pytest.mark.parametrize("header", ["tp,mbs,kind,forward,backward", "mbs,tp,kind,forward_s,backward_s",
                                    "tp,mbs,kind,forward_s", ""], ids=["names", "order", "short", "empty"])
def test_profile_with_wrong_header(runner, tiny, header):
    rows = profile_csv("fast").replace("tp,mbs,kind,forward_s,backward_s", header)
    setup = tiny(profiles={"fast": rows})
    result, output = search_error(runner, setup)
    assert_input_error(result, "fast.csv", output=output)


@pytest.mark.parametrize("bad", ["1,1,layer,fast,0.01", "1,1,layer,0.005,", "x,1,layer,0.005,0.01",
                                 "1,1,layer,-0.005,0.01", "1,1,layer,nan,0.01", "1,1,layer,0.005"],
                         ids=["word", "empty", "tp", "negative", "nan", "short-row"])
def test_profile_with_bad_row(runner, tiny, bad):
    lines = profile_csv("fast").splitlines()
    lines = [bad if line.startswith("1,1,layer,") else line for line in lines]
    setup = tiny(profiles={"fast": "\n".join(lines) + "\n"})
    result, output = search_error(runner, setup)
    line = assert_input_error(result, "fast.csv", output=output)
    assert "line" in line


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_profile_with_infinite_time(runner, tiny):
    lines = [("1,1,layer,inf,0.01" if line.startswith("1,1,layer,") else line) for line in profile_csv("fast").splitlines()]
    setup = tiny(profiles={"fast": "\n".join(lines) + "\n"}, tps=(1,))
    result, output = search_error(runner, setup)
    assert_input_error(result, "fast.csv", output=output)


def test_profile_with_unknown_kind(runner, tiny):
    setup = tiny(profiles={"fast": profile_csv("fast") + "1,1,encoder,0.005,0.01\n"})
    result, output = search_error(runner, setup)
    assert_input_error(result, "fast.csv", "encoder", output=output)


def test_profile_missing_a_kind_for_one_tp(runner, tiny):
    text = profile_csv("slow", tps=(1,)) + "".join(
        line + "\n" for line in profile_csv("slow", tps=(2,), kinds=("embedding", "layer")).splitlines()[2:])
    setup = tiny(profiles={"slow": text})
    result, output = search_error(runner, setup)
    line = assert_input_error(result, "slow.csv", output=output)
    assert "tp=2" in line and "head" in line


def test_profile_with_duplicate_row(runner, tiny):
    setup = tiny(profiles={"fast": profile_csv("fast") + "1,1,layer,0.005,0.01\n"})
    result, output = search_error(runner, setup)
    assert_input_error(result, "fast.csv", output=output)


def test_missing_profiles_directory(runner, tiny, tmp_path):
    setup = tiny()
    missing = tmp_path / "no-such-profiles"
    output = setup.root / "plans.json"
    result = invoke(runner, ["search", "--model", setup.model, "--cluster", setup.cluster,
                             "--profiles", missing, "--output", output])
    assert_input_error(result, "--profiles", output=output)


def test_model_without_bundled_profiles(runner, tiny):
    """A custom model without --profiles looks for bundled profiles/<name>, which it does not have."""
    setup = tiny()
    output = setup.root / "plans.json"
    result = invoke(runner, ["search", "--model", setup.model, "--cluster", setup.cluster, "--output", output])
    assert_input_error(result, "tiny", output=output)


@pytest.mark.parametrize("tp", ["2", "4", "3"])
def test_estimate_tp_without_profile(runner, tiny, tp):
    setup = tiny(tps=(1,))
    result = invoke(runner, ["estimate", *setup.args("--tp", tp, "--dp", "1", "--pp", "2", "--mbs", "1",
                                                     "--placement", "fast,slow", "--layers", "2,2")])
    assert_input_error(result, "--tp")


@pytest.mark.parametrize("layers", ["1,1,1", "2,2,2,2", "4", "1,1,1,1,0", "a,b,c,d", "1,-1,3,1", ""])
def test_estimate_bad_layers(runner, tiny, layers):
    args = TINY_PLAN[:-1] + [layers]
    result = invoke(runner, ["estimate", *tiny().args(*args)])
    assert_input_error(result, "--layers")


def test_estimate_empty_middle_stage(runner, tiny):
    args = TINY_PLAN[:-1] + ["2,0,1,1"]
    assert_input_error(invoke(runner, ["estimate", *tiny().args(*args)]), "--layers")


@pytest.mark.parametrize("placement", ["fast,medium", "fast,fast", "slow,slow,fast"],
                         ids=["unknown-type", "too-many-of-a-type", "too-many-nodes"])
def test_estimate_bad_placement(runner, tiny, placement):
    args = [a if a != "fast,slow" else placement for a in TINY_PLAN]
    result = invoke(runner, ["estimate", *tiny().args(*args)])
    assert_input_error(result, "--placement")


def test_estimate_placement_not_matching_degrees(runner, tiny):
    args = [a if a != "fast,slow" else "fast" for a in TINY_PLAN]
    assert_input_error(invoke(runner, ["estimate", *tiny().args(*args)]), "--placement")


def test_estimate_mbs_not_dividing_gbs(runner, tiny):
    args = list(TINY_PLAN)
    args[args.index("--mbs") + 1] = "3"
    assert_input_error(invoke(runner, ["estimate", *tiny().args(*args)]), "--mbs")


def test_search_gbs_zero(runner, tiny):
    result, output = search_error(runner, tiny(), "--gbs", "0")
    assert_input_error(result, "--gbs", output=output)


def test_estimate_gbs_zero(runner, tiny):
    assert_input_error(invoke(runner, ["estimate", *tiny().args(*TINY_PLAN, "--gbs", "0")]), "--gbs")


def test_search_gbs_negative(runner, tiny):
    result, output = search_error(runner, tiny(), "--gbs", "-8")
    assert_input_error(result, "--gbs", output=output)


def test_gbs_no_plan_can_use(runner, tiny):
    """One layer (at most 3 stages), only tp=1 profiled, 4 GPUs, gbs 3: dp divides 3 and 4 so dp=1, pp=4 > 3."""
    setup = tiny(model={"num_layers": 1, "global_batch_size": 3}, tps=(1,))
    result, output = search_error(runner, setup, "--use-all")
    assert_input_error(result, "--gbs", "3", output=output)
    result, output = search_error(runner, tiny("other", tps=(1,), model={"num_layers": 1}), "--gbs", "3", "--use-all")
    assert_input_error(result, "--gbs", output=output)
    # one node type alone (2 GPUs: dp 1, pp 2) can: the plans leave the other idle, and say so
    result, output = search_error(runner, setup)
    ok(result)
    assert {len(plan["placement"]) for plan in json.loads(output.read_text())} == {1}
    assert "note: no plan uses every node; the best leaves " in result.stdout


def test_nothing_fits_in_memory_says_how_far(runner, tiny):
    setup = tiny(nodes={"fast": {"gpu_memory_gib": 0.001}, "slow": {"gpu_memory_gib": 0.001}})
    result, output = search_error(runner, setup)
    line = assert_input_error(result, "cluster.toml", "memory", output=output)
    match = re.search(r"needs ([0-9.]+)x the GPU memory", line)
    assert match, line
    factor = float(match.group(1))
    assert factor > 1
    # the factor is right: a little more memory than that fits the closest plan, a little less fits none
    roomy = tiny("roomy", nodes={t: {"gpu_memory_gib": 0.001 * factor * 1.02} for t in ("fast", "slow")})
    ok(invoke(runner, ["search", *roomy.args()]))
    tight = tiny("tight", nodes={t: {"gpu_memory_gib": 0.001 * factor * 0.98} for t in ("fast", "slow")})
    assert_input_error(invoke(runner, ["search", *tight.args()]), "memory")


def test_bad_input_in_a_real_process(tiny):
    """The same contract outside the test runner: stderr, exit status and files of a real `fasop` process."""
    setup = tiny(nodes={"fast": {"gpu_memory_gib": 0.001}, "slow": {"gpu_memory_gib": 0.001}})
    output = setup.root / "plans.csv"
    done = subprocess.run([sys.executable, "-c", "from fasop.cli import main; main()", "search",
                           *setup.args("--output", str(output))], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:") and "needs" in lines[0], done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not output.exists()


@pytest.mark.parametrize("name", ["plans.txt", "plans", "plans.JSON.bak"])
def test_output_with_bad_suffix(runner, tiny, name):
    setup = tiny()
    output = setup.root / name
    result = invoke(runner, ["search", *setup.args("--output", output)])
    assert_input_error(result, "--output", output=output)


def test_train_steps_and_tokens_together(runner, tiny):
    result, output = search_error(runner, tiny(), "--train-steps", "10", "--train-tokens", "1000")
    line = assert_input_error(result, output=output)
    assert "--train-steps" in line and "--train-tokens" in line


@pytest.mark.parametrize("tokens", ["1e400", "nan", "1e308", "1e16"])
def test_train_tokens_not_finite_or_too_many(runner, tiny, tokens):
    result, output = search_error(runner, tiny(), "--train-tokens", tokens)
    assert_input_error(result, "--train-tokens", output=output)


def test_train_steps_beyond_exact_integers(runner, tiny):
    result, output = search_error(runner, tiny(), "--train-steps", str(2**53 + 1))
    assert_input_error(result, "--train-steps", output=output)


def test_model_path_is_a_directory(runner, tiny):
    setup = tiny()
    folder = setup.root / "models.toml"
    folder.mkdir()
    output = setup.root / "plans.json"
    result = invoke(runner, ["search", "--model", folder, "--cluster", setup.cluster, "--profiles", setup.profiles,
                             "--output", output])
    assert_input_error(result, "models.toml", output=output)


def test_model_file_not_utf8(runner, tiny):
    setup = tiny()
    setup.model.write_bytes(b'[model]\nname = "tiny\xff"\n')
    result, output = search_error(runner, setup)
    assert_input_error(result, "model.toml", output=output)


def test_profile_not_utf8(runner, tiny):
    setup = tiny()
    (setup.profiles / "fast.csv").write_bytes(profile_csv("fast").encode() + b"1,1,layer\xff,0.005,0.01\n")
    result, output = search_error(runner, setup)
    assert_input_error(result, "fast.csv", output=output)


def test_estimate_encoder_decoder_split_off_the_boundary(runner):
    """t5 has 24 encoder layers: 10,10,16,12 puts no stage boundary after them."""
    result = invoke(runner, ["estimate", "--model", "t5", "--cluster", "fasop-4xA10", "--tp", "1", "--dp", "4",
                             "--pp", "4", "--mbs", "1", "--placement", "A10,A10,A10,A10", "--layers", "10,10,16,12"])
    assert_input_error(result, "--layers", "encoder")


def test_search_offers_only_tensor_degrees_dividing_the_heads(runner, tiny):
    setup = tiny(model={"num_attention_heads": 3, "kv_channels": 21})
    plans = tiny_plans(runner, setup)
    assert all(3 % p["tp"] == 0 for p in plans), sorted({p["tp"] for p in plans})


@pytest.mark.parametrize("command", ["search", "estimate"])
def test_unknown_bundled_model(runner, tmp_path, command):
    extra = ["--output", tmp_path / "plans.json"] if command == "search" else BERT_PLAN
    result = invoke(runner, [command, "--model", "no-such-model", "--cluster", "fasop-1xA100-3xA10", *extra])
    assert_input_error(result, "--model", "no-such-model", output=tmp_path / "plans.json")


@pytest.mark.parametrize("command", ["search", "estimate"])
def test_unknown_bundled_cluster(runner, tmp_path, command):
    extra = ["--output", tmp_path / "plans.json"] if command == "search" else BERT_PLAN
    result = invoke(runner, [command, "--model", "bert", "--cluster", "no-such-cluster", *extra])
    assert_input_error(result, "--cluster", "no-such-cluster", output=tmp_path / "plans.json")


def test_missing_model_file(runner, tmp_path):
    output = tmp_path / "plans.json"
    result = invoke(runner, ["search", "--model", tmp_path / "absent.toml", "--cluster", "fasop-4xA10", "--output", output])
    assert_input_error(result, "absent.toml", output=output)


def test_estimate_reports_bad_files_too(runner, tiny):
    setup = tiny(model={"hidden_size": None})
    assert_input_error(invoke(runner, ["estimate", *setup.args(*TINY_PLAN)]), "model.toml", "hidden_size")
    setup = tiny("cluster", nodes={"slow": {"inter_node_bandwidth": "40 Gb/s"}})
    assert_input_error(invoke(runner, ["estimate", *setup.args(*TINY_PLAN)]), "cluster.toml", "inter_node_bandwidth")
    setup = tiny("profile", profiles={"slow": None})
    assert_input_error(invoke(runner, ["estimate", *setup.args(*TINY_PLAN)]), "slow.csv")


def test_model_file_is_the_tiny_model(tiny):
    """The fixture writes what the tests assume."""
    setup = tiny()
    model = load_model(str(setup.model))
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.seq_length,
            model.vocab_size, model.global_batch_size, model.precision) == (4, 64, 4, 32, 1000, 8, "fp16")
    cluster = load_cluster(str(setup.cluster))
    assert cluster.num_gpus == 4 and set(cluster.node_types) == {"fast", "slow"}
    assert model_toml().startswith("[model]")
