"""Every bundled model plans on every bundled cluster out of the box: a GPU type without a bundled profile of the
model gets the profile `fasop profile synth` would write, said in one line on stderr and recorded in the plan
file; bundled and --profiles profiles always win; a GPU type nothing can be synthesised for is one clear error."""

from __future__ import annotations

import json
import re

import pytest
from conftest import gpu_table, one_line_error

from fasop.cli import main
from fasop.inputs import bundled
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.inputs.profiles import load_profiles

MODELS = bundled.names("models", ".toml")
CLUSTERS = bundled.names("clusters", ".toml")
# A global batch every bundled model has plan shapes for on every bundled cluster (the 1,024-GPU one needs 16
# data-parallel ranks for bert), small enough to keep the 56 searches to seconds each.
SMALL_BATCH = "16"
NOTE = "note: no profile of "


def bundled_profile_gpus(model: str) -> set[str]:
    return {path.stem for path in (bundled.data_dir("profiles") / model).glob("*.csv")}


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("model", MODELS)
def test_every_bundled_model_searches_on_every_bundled_cluster(runner, tmp_path, model, cluster):
    output = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", model, "--cluster", cluster, "--top", "1", "--prune",
                                  "--gbs", SMALL_BATCH, "--output", str(output)])
    assert "Traceback" not in result.output
    gpus = {node.gpu for node in load_cluster(cluster).node_types.values()}
    synthesised = sorted(gpus - bundled_profile_gpus(model))
    notes = [line for line in result.stderr.splitlines() if line.startswith(NOTE)]
    if result.exit_code != 0:  # no plan fits: the one error line, the notes said only after a result
        assert result.exit_code == 2 and not notes and len(result.stderr.strip().splitlines()) == 1, result.stderr
    elif synthesised:
        assert len(notes) == 1 and f"{NOTE}{model} for {', '.join(synthesised)}: synthesised" in notes[0], notes
        assert f"fasop profile layers --model {model} --gpu GPU" in notes[0]
    else:
        assert not notes
    if result.exit_code == 0:
        plan = json.loads(output.read_text())[0]
        used = {node.gpu for name, node in load_cluster(cluster).node_types.items() if name in plan["placement"]}
        assert plan.get("synthesised_profiles") == (sorted(used - bundled_profile_gpus(model)) or None)  # its own GPUs
        assert "profiles" not in plan  # the bundled ones and those synthesised
        return
    # one line as by any search: a 70B model on 16 or 32 A10s fits nowhere; nodes holding several GPU kinds are for
    # stage-group plans only; 16 sequences are too few for bert on 16,384 GPUs
    assert result.exit_code == 2 and not output.exists(), result.output
    refusals = (f"Error: --cluster {cluster}: no plan fits in memory", "only stage-group plans use them (--stage-groups)",
                f"Error: --gbs: no plan can use a global batch size of {SMALL_BATCH} on")
    assert any(refusal in result.stderr.splitlines()[-1] for refusal in refusals), result.stderr


def test_a_synthesised_profile_is_the_one_profile_synth_writes(runner, tmp_path):
    out = tmp_path / "H100.csv"
    written = runner.invoke(main, ["profile", "synth", "--model", "llama3-8b", "--gpu", "H100", "--out", str(out)])
    assert written.exit_code == 0, written.output
    model = load_model("llama3-8b")
    from_file = load_profiles(model, ["H100"], str(tmp_path))["H100"]
    made = load_profiles(model, ["H100"])["H100"]
    assert made.synthesised and not from_file.synthesised
    assert made.tensor_degrees == from_file.tensor_degrees == (1, 2, 4, 8)
    for tp, kind in from_file.curves:
        for mbs in (1, 3, 8, 16):  # profiled sizes, and the roofline's shape between and beyond them
            assert made.time(tp, kind, mbs) == pytest.approx(from_file.time(tp, kind, mbs), rel=1e-10)


def test_bundled_profiles_win_and_only_gpu_types_without_one_are_synthesised():
    model = load_model("gpt2-xl")
    profiles = load_profiles(model, ["A100", "A10G", "L4"])
    assert [gpu for gpu, profile in profiles.items() if profile.synthesised] == ["L4"]
    measured = profiles["A100"]  # FASOP's measured profile, far slower than the roofline
    assert measured.file.endswith("A100.csv") and measured.tensor_degrees == (1, 2, 4)
    assert load_profiles(model, ["A10G"])["A10G"].file.endswith("A10G.csv")  # a bundled synthetic one, calibrated


def test_a_profiles_folder_must_hold_every_gpu_type(runner, tmp_path):
    folder = tmp_path / "mine"
    made = runner.invoke(main, ["profile", "synth", "--model", "llama3-8b", "--gpu", "H100", "--out",
                                str(folder / "H100.csv")])
    assert made.exit_code == 0, made.output
    result = runner.invoke(main, ["search", "--model", "llama3-8b", "--cluster", "pareto-h100-a100-a10g",
                                  "--profiles", str(folder)])
    one_line_error(result, str(folder / "A100.csv"), "no profile of model llama3-8b for GPU type A100",
                   "fasop profile layers --model llama3-8b --gpu A100 --out", "fasop profile synth")


def test_a_gpu_type_without_a_profile_or_a_spec_is_one_line_saying_how_to_make_one(runner, tiny):
    setup = tiny()  # the tiny model has no bundled profiles, and its GPU types "fast" and "slow" no spec
    result = runner.invoke(main, ["search", "--model", str(setup.model), "--cluster", str(setup.cluster)])
    one_line_error(result, "model tiny", "no profile for GPU type fast", "no spec of fast", "[[gpu]] table of fast",
                   f"fasop profile layers --model {setup.model} --gpu fast --out DIR/fast.csv", "(--profiles)")


def test_a_gpu_table_in_the_cluster_file_is_enough_to_synthesise_from(runner, tiny, tmp_path):
    setup = tiny(cluster_extra=gpu_table("fast") + gpu_table("slow", dense_fp16_tflops=50.0))
    output = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", str(setup.model), "--cluster", str(setup.cluster),
                                  "--output", str(output)])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"{NOTE}tiny for fast, slow: synthesised")
    plans = json.loads(output.read_text())
    assert all(plan["synthesised_profiles"] == sorted(set(plan["placement"])) for plan in plans)  # its own GPUs
    assert any(plan["synthesised_profiles"] == ["fast", "slow"] for plan in plans)
    csv_output = tmp_path / "plans.csv"
    assert runner.invoke(main, ["search", "--model", str(setup.model), "--cluster", str(setup.cluster),
                                "--output", str(csv_output)]).exit_code == 0
    header, *rows = csv_output.read_text().splitlines()
    assert "synthesised_profiles" in header.split(",") and any(",fast slow," in row for row in rows)


def test_a_precision_without_a_tensor_core_peak_cannot_be_synthesised(runner, tiny):
    setup = tiny(model={"precision": "fp32"}, cluster_extra=gpu_table("fast") + gpu_table("slow"))
    result = runner.invoke(main, ["search", "--model", str(setup.model), "--cluster", str(setup.cluster)])
    one_line_error(result, "no profile for GPU type fast, and none can be synthesised", "fp32")


def test_emit_reads_the_profiles_folder_the_plan_file_names(runner, tiny, tmp_path, monkeypatch):
    setup = tiny()
    monkeypatch.chdir(setup.root)  # paths as given: relative to here
    result = runner.invoke(main, ["search", "--model", "model.toml", "--cluster", "cluster.toml", "--profiles",
                                  "profiles", "--output", "plans.json"])
    assert result.exit_code == 0, result.output
    assert NOTE not in result.stderr
    plan = json.loads((setup.root / "plans.json").read_text())[0]
    assert plan["profiles"] == "profiles" and "synthesised_profiles" not in plan
    monkeypatch.chdir(tmp_path)  # elsewhere: the files the plan names are found beside it
    emitted = runner.invoke(main, ["emit", "--smoke-test", "--plans", str(setup.root / "plans.json"), "--out", "run"])
    assert emitted.exit_code == 0, emitted.output
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["profiles"] == "profiles"
    other = tmp_path / "other"
    other.mkdir()
    (other / "fast.csv").write_text((setup.profiles / "slow.csv").read_text())  # a slower GPU: other figures
    (other / "slow.csv").write_text((setup.profiles / "slow.csv").read_text())
    given = runner.invoke(main, ["emit", "--smoke-test", "--plans", str(setup.root / "plans.json"), "--out", "run2", "--profiles",
                                 str(other)])
    one_line_error(given, "stale plan")  # --profiles wins over the plan's folder


def test_a_plan_made_with_synthesised_profiles_emits_without_more_options(runner, tmp_path):
    plans = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", "llama3-8b", "--cluster", "pareto-h100-a100-a10g", "--gbs",
                                  SMALL_BATCH, "--top", "1", "--prune", "--output", str(plans)])
    assert result.exit_code == 0, result.output
    emitted = runner.invoke(main, ["emit", "--smoke-test", "--plans", str(plans), "--out", str(tmp_path / "run")])
    assert emitted.exit_code == 0, emitted.output
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    gpus = {t.name: t.gpu for t in load_cluster("pareto-h100-a100-a10g").node_types.values()}
    assert plan["synthesised_profiles"] == sorted({gpus[name] for name in plan["placement"]})


def test_calibrate_writes_synthesised_profiles_scaled(runner, tmp_path):
    """Measured step times and no profile: the synthesised ones are calibrated and written as files."""
    model = load_model("llama3-8b")
    runs = ["run,model_file,cluster_file,gbs,mbs,tp,dp,pp,placement,layers_per_stage,measured_step_s"]
    for i, (tp, dp, mbs) in enumerate([(8, 1, 1), (4, 2, 2), (2, 4, 1)]):
        estimate = runner.invoke(main, ["estimate", "--model", "llama3-8b", "--cluster", "pareto-h100-a100-a10g",
                                        "--gbs", SMALL_BATCH, "--tp", str(tp), "--dp", str(dp), "--pp", "1", "--mbs",
                                        str(mbs), "--placement", "H100", "--layers", "32", "--json"])
        assert estimate.exit_code == 0, estimate.output
        assert estimate.stderr.startswith(f"{NOTE}llama3-8b for A100, A10G, H100: synthesised")
        record = json.loads(estimate.stdout)
        assert record["synthesised_profiles"] == ["H100"]  # the GPU types of the plan's placement
        step_s = record["step_time_s"] * 1.25  # the real GPU: slower than the roofline
        runs.append(f"r{i},llama3-8b,pareto-h100-a100-a10g,{SMALL_BATCH},{mbs},{tp},{dp},1,H100,32,{step_s!r}")
    measured = tmp_path / "runs.csv"
    measured.write_text("\n".join(runs) + "\n")
    out, profiles_out = tmp_path / "calibrated.toml", tmp_path / "calibrated-profiles"
    result = runner.invoke(main, ["calibrate", "--measured", str(measured), "--out", str(out),
                                  "--profiles-out", str(profiles_out)])
    assert result.exit_code == 0, result.output
    assert result.stderr.count(f"{NOTE}llama3-8b for A100, A10G, H100: synthesised") == 1
    factor = float(re.search(r"compute_time_scale\.H100\s+([\d.]+)", result.stdout).group(1))
    text = (profiles_out / "H100.csv").read_text()
    assert "Synthetic profile of llama3-8b on H100" in text and "compute_time_scale.H100" in text
    calibrated = load_profiles(model, ["H100"], str(profiles_out))["H100"]
    synthesised = load_profiles(model, ["H100"])["H100"]
    ratios = [c / s for tp, kind in synthesised.curves
              for c, s in zip(calibrated.time(tp, kind, 2), synthesised.time(tp, kind, 2))]
    # one factor, on every row: the host is as the spec says (host_time_scale fitted to 1, to the solver's tolerance)
    assert re.search(r"host_time_scale\.H100\s+1\.0000\s", result.stdout)
    assert ratios == pytest.approx([ratios[0]] * len(ratios), rel=1e-6)
    assert ratios[0] == pytest.approx(factor, rel=1e-3)  # the one printed (to 4 digits)
