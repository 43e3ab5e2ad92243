"""The plan record (fasop.plans.Plan): its published schema, and plan files checked once against it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fasop.cli import main
from fasop.errors import InputError
from fasop.plans import Plan, load_plans
from fasop.runtime import load_plan

ROOT = Path(__file__).resolve().parents[1]
STAGE = {"stage": 0, "gpu": "A10", "nodes": [0], "layers": 48, "compute_s": 0.5, "p2p_s": 0.0,
         "dp_allreduce_s": 0.1, "memory_gib": 10.0, "memory_capacity_gib": 24.0}
PLAN = {"rank": 1, "model": "gpt2-xl", "gbs": 8, "mbs": 1, "tp": 1, "dp": 1, "pp": 1, "num_microbatches": 8,
        "placement": ["A10"], "layers_per_stage": [48], "step_time_s": 4.6, "stages": [STAGE]}


def test_the_published_schema_is_the_models():
    """docs/formats.md holds the schema exactly as scripts/plan_schema.py writes it from the model."""
    spec = importlib.util.spec_from_file_location("plan_schema", ROOT / "scripts" / "plan_schema.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = (ROOT / "docs" / "formats.md").read_text()
    assert script.page_with_schema(page) == page, "the plan schema in docs/formats.md is stale: python scripts/plan_schema.py"


def write(tmp_path: Path, plans) -> Path:
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(plans))
    return path


@pytest.mark.parametrize("change, where, problem", [
    ({"steptime_s": 1.0}, "entry 1: steptime_s", "unknown field"),
    ({"stages": [{**STAGE, "memory_gib": "10"}]}, "entry 1: stages[0].memory_gib", "valid number"),
    ({"stages": [{**STAGE, "compute": 0.5}]}, "entry 1: stages[0].compute", "unknown field"),
    ({"placement": ["A10", ""]}, "entry 1: placement[1]", "expected a node-type name"),
    ({"tp": True}, "entry 1: tp", "expected an integer from 1"),
    ({"kind": "zero2"}, "entry 1", "a zero2 plan needs per_type and gpus_per_node"),
    ({"rank": None}, "entry 1: rank", "missing"),
])
def test_a_bad_plan_is_one_line_naming_file_entry_and_field(tmp_path, change, where, problem):
    path = write(tmp_path, [PLAN, {**PLAN, "rank": 2, **change}])
    with pytest.raises(InputError) as err:
        load_plans(path)
    assert str(err.value).startswith(f"{path}: {where}:") and problem in str(err.value), str(err.value)
    result = CliRunner().invoke(main, ["plot", "--plan", str(path), "--rank", "1", "--out", str(tmp_path / "s.png")])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1 and where in result.output
    assert not (tmp_path / "s.png").exists()


def test_a_plan_file_reads_back_the_plans_of_the_search(tmp_path):
    path = tmp_path / "plans.json"
    result = CliRunner().invoke(main, ["search", "--model", "bert", "--cluster", "fasop-4xA10", "--output", str(path)])
    assert result.exit_code == 0, result.output
    plans = load_plans(path)
    assert [plan.record() for plan in plans] == json.loads(path.read_text())
    assert [list(plan.record()) for plan in plans] == [list(entry) for entry in json.loads(path.read_text())]
    best = plans[0]
    assert best.rank == 1 and best.kind == "3d" and best.stages and sum(s.layers for s in best.stages) == 24


def test_the_plan_file_is_written_plan_by_plan_as_one_json_text_would_be(tmp_path):
    import fasop
    from fasop.plans import PlanFile

    plans = fasop.search_plans(fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-1xA100-3xA10")).plans
    plan_file = PlanFile(plans, tmp_path / "plans.json")
    chunks = list(plan_file.chunks())
    assert len(chunks) == len(plans) + 1 and plan_file.written == len(plans) and plan_file.left_out() == ""
    assert "".join(chunks) == json.dumps([plan.record() for plan in plans], indent=1) + "\n"
    assert "".join(PlanFile([], tmp_path / "none.json").chunks()) == "[]\n"


def test_a_json_plan_file_holds_the_best_plans_fasop_reads_back(tmp_path, monkeypatch):
    """Past the size fasop reads back, the plans ranked below are left out, the file stays a valid plan list
    as large as the limit allows, and the search says so; a CSV file holds every plan."""
    import fasop.plans

    path = tmp_path / "plans.json"
    search = ["search", "--model", "bert", "--cluster", "fasop-4xA10", "--top", "1"]
    whole = CliRunner().invoke(main, [*search, "--output", str(path)])
    assert whole.exit_code == 0, whole.output
    everything = path.read_text()
    records = json.loads(everything)
    limit = len(everything) // 3
    monkeypatch.setattr(fasop.plans, "PLANS_LIMIT_BYTES", limit)
    cut = CliRunner().invoke(main, [*search, "--output", str(path), "--force"])
    assert cut.exit_code == 0, cut.output
    kept = load_plans(path)  # read back under the same limit
    text = path.read_text()
    assert len(text) <= limit < len(json.dumps(records[:len(kept) + 1], indent=1) + "\n")
    assert [plan.record() for plan in kept] == records[:len(kept)] and 1 < len(kept) < len(records)
    assert (f"{len(kept)} plans written to {path}; the {len(records) - len(kept)} ranked below them are left out"
            in cut.output)
    csv_path = tmp_path / "plans.csv"
    full = CliRunner().invoke(main, [*search, "--output", str(csv_path)])
    assert f"{len(records)} plans written to {csv_path}\n" in full.output


def test_a_plan_without_kind_is_3d_and_written_without_one():
    plan = Plan.model_validate(PLAN)
    assert plan.kind == "3d" and plan.encoder_stages == 0
    assert plan.record() == PLAN  # only what the file gave, in the schema's order


def test_the_runtime_reads_one_plan_object_through_the_schema(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**PLAN, "kind": "ddp", "gpus_per_node": 1, "per_type": [{"oops": 1}]}))
    with pytest.raises(InputError, match=r"plan.json: per_type\[0\].oops: unknown field"):
        load_plan(path)


def test_trusted_stage_rows_are_what_model_construct_builds():
    """Plan.trusted builds stage rows without pydantic's model_construct (for speed): the same objects, the same
    given fields, defaults for the others."""
    import fasop
    from fasop.plans import Stage

    plan = fasop.search_plans(fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-8xA10")).plans[0]
    record = plan.record()
    partial = {key: value for key, value in record["stages"][0].items() if key not in ("forward_s", "send_s")}
    for values in [*record["stages"], partial]:
        fast, slow = Plan.trusted({**record, "stages": [values]}).stages[0], Stage.model_construct(**values)
        assert fast == slow and type(fast) is Stage
        assert fast.model_dump(exclude_unset=True) == slow.model_dump(exclude_unset=True) == values
        assert fast.model_fields_set == slow.model_fields_set and fast.send_s == slow.send_s
    assert Plan.trusted(record).record() == Plan.model_validate(record).record()
