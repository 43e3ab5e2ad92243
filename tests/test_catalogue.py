"""The user's own GPUs: [[gpu]] tables in a --catalogue file or in the cluster file, merged over the bundled
catalogue, used by `fasop profile synth`, and refused with one line when a value is wrong."""

import csv
import json
import math
from pathlib import Path

import pytest
from conftest import toml_table

from fasop.cli import main
from fasop.cost.roofline import unit_work
from fasop.inputs.catalogue import load_gpu_specs
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model

MY_GPU = {"name": "MyGPU-24G", "dense_fp16_tflops": 100.0, "dense_bf16_tflops": 100.0, "memory_gib": 24.0,
          "memory_bandwidth_gb_per_s": 1000.0, "intra_node_link": "25 GB/s", "matmul_efficiency": 0.5,
          "source": "my own datasheet", "date": "2026-01-01"}


def _gpu_toml(**changes) -> str:
    fields = {**MY_GPU, **changes}
    return toml_table("[[gpu]]", {k: v for k, v in fields.items() if v is not None})


def _layer_times(path) -> dict:
    lines = Path(path).read_text().splitlines()
    rows = csv.DictReader(line for line in lines if not line.startswith("#"))
    return {(r["tp"], r["mbs"], r["kind"]): (float(r["forward_s"]), float(r["backward_s"])) for r in rows}


def _synth(runner, tiny_files, out, *options):
    return runner.invoke(main, ["profile", "synth", "--model", str(tiny_files.model), "--tp", "1,2", "--mbs", "1",
                                "--out", str(out), *options])


def test_a_gpu_of_a_catalogue_file_is_used_by_synth(runner, tiny, tmp_path):
    files = tiny()
    catalogue = tmp_path / "my-gpus.toml"
    catalogue.write_text(_gpu_toml())
    out = tmp_path / "MyGPU-24G.csv"
    result = _synth(runner, files, out, "--gpu", "MyGPU-24G", "--catalogue", str(catalogue))
    assert result.exit_code == 0, result.output
    assert str(catalogue) in out.read_text()  # the header names the table the figures came from
    # the roofline by hand: 100 TFLOP/s x 0.5, 1000 GB/s, 25 GB/s for the tensor-parallel collectives, and
    # the default 5 us per kernel launch for a table without kernel_launch_us, kernel after kernel
    model = load_model(str(files.model))
    work = unit_work(model, tp=2, mbs=1)["layer"]
    gpu_s = [max(k.flops / 50e12, k.bytes / 1e12) / k.launches for k in work.forward for _ in range(k.launches)]
    gpu_s += [0.5 * payload / 25e9 for payload in work.collectives]  # no measured curve: the nominal link

    def pass_s(launch_s: float) -> float:
        host_t = gpu_t = 0.0
        for g in gpu_s:  # the host launches, the GPU runs each once launched and the one before is done
            host_t += launch_s
            gpu_t = max(host_t, gpu_t) + g
        return gpu_t

    assert _layer_times(out)[("2", "1", "layer")][0] == pytest.approx(pass_s(5e-6), rel=1e-9)
    # the field, when given, replaces the default
    catalogue.write_text(_gpu_toml(kernel_launch_us=0.0))
    assert _synth(runner, files, out, "--gpu", "MyGPU-24G", "--catalogue", str(catalogue), "--force").exit_code == 0
    assert _layer_times(out)[("2", "1", "layer")][0] == pytest.approx(pass_s(0.0), rel=1e-9)
    assert pass_s(0.0) == pytest.approx(sum(gpu_s), rel=1e-12) and pass_s(0.0) < pass_s(5e-6)


def test_a_catalogue_entry_replaces_the_bundled_gpu_of_its_name(runner, tiny, tmp_path):
    files = tiny()
    bundled, mine = tmp_path / "bundled.csv", tmp_path / "mine.csv"
    assert _synth(runner, files, bundled, "--gpu", "A100").exit_code == 0
    catalogue = tmp_path / "gpus.toml"
    catalogue.write_text(_gpu_toml(name="A100", dense_fp16_tflops=31.2, memory_bandwidth_gb_per_s=155.5, sm_count=108))
    assert _synth(runner, files, mine, "--gpu", "A100", "--catalogue", str(catalogue)).exit_code == 0
    slow, fast = _layer_times(mine), _layer_times(bundled)
    # at tp 1 (at tp 2 the bundled A100's measured all-reduce curve charges NCCL's latency on these tiny
    # payloads, which the table without a curve does not)
    assert all(slow[key][0] > fast[key][0] for key in fast if key[0] == "1")


def test_a_gpu_table_in_the_cluster_file_is_used_by_synth_and_the_cluster_still_searches(runner, tiny, tmp_path):
    files = tiny(cluster_extra="\n" + _gpu_toml(name="fast"))
    cluster = load_cluster(str(files.cluster))
    assert cluster.gpus["fast"].memory_gib == 24.0
    out = tmp_path / "fast.csv"
    result = _synth(runner, files, out, "--gpu", "fast", "--cluster", str(files.cluster))
    assert result.exit_code == 0, result.output
    assert str(files.cluster) in out.read_text()
    # the cluster file wins over a --catalogue file
    catalogue = tmp_path / "gpus.toml"
    catalogue.write_text(_gpu_toml(name="fast", dense_fp16_tflops=1.0))
    again = tmp_path / "again.csv"
    assert _synth(runner, files, again, "--gpu", "fast", "--cluster", str(files.cluster),
                  "--catalogue", str(catalogue)).exit_code == 0
    assert _layer_times(again) == _layer_times(out)
    assert runner.invoke(main, ["search", *files.args()]).exit_code == 0
    # without either, the GPU is unknown
    result = _synth(runner, files, tmp_path / "x.csv", "--gpu", "fast")
    assert result.exit_code == 2 and "--gpu fast" in result.stderr


BAD = [
    ({"dense_fp16_tflops": 3.12e14}, "dense_fp16_tflops", "<= 10000"),  # FLOP/s, not TFLOP/s
    ({"dense_fp16_tflops": 0.0}, "dense_fp16_tflops", ">= 0.01"),
    ({"dense_bf16_tflops": -1.0}, "dense_bf16_tflops", ">= 0"),
    ({"memory_gib": math.nan}, "memory_gib", "got nan"),
    ({"memory_bandwidth_gb_per_s": math.inf}, "memory_bandwidth_gb_per_s", "got inf"),
    ({"memory_gib": 25769803776}, "memory_gib", "<= 1024"),  # bytes, not GiB
    ({"matmul_efficiency": 1.5}, "matmul_efficiency", "<= 1"),
    ({"matmul_efficiency": "high"}, "matmul_efficiency", "expected a number"),
    ({"intra_node_link": "25 Gbps"}, "intra_node_link", "bandwidth"),
    ({"kernel_launch_us": -1.0}, "kernel_launch_us", ">= 0"),
    ({"kernel_launch_us": 5000.0}, "kernel_launch_us", "<= 1000"),  # nanoseconds, not microseconds
    ({"name": "my gpu"}, "name", "letters, digits"),
    ({"name": "$(reboot)"}, "name", "letters, digits"),
    ({"memory_gib": None}, "memory_gib", "missing"),
    ({"tdp_w": 300}, "tdp_w", "unknown field"),
    ({"attention_tflops": [[64, 1024, 300, 400, 300], [64, 512, 200, 300, 250]]}, "attention_tflops", "increasing"),
    ({"attention_tflops": [[64, 1024, 300, 400, 300], [128, 1024, 400, 500, 400]]}, "attention_tflops",
     "2 or more"),
    ({"attention_tflops": [[64, 512, 3e14, 400, 300], [64, 1024, 300, 400, 300]]}, "attention_tflops",
     "<= 100000"),  # FLOP/s, not TFLOP/s
    ({"attention_tflops": [[64, 512, 300, 400], [64, 1024, 300, 400]]}, "attention_tflops", "head_dim"),
    # a power limit never makes a GEMM faster than timed alone; an FP8 figure needs FP8 tensor cores
    ({"sustained_matmul_efficiency": 0.95}, "sustained_matmul_efficiency", "never faster"),
    ({"sustained_fp8_matmul_efficiency": 0.5}, "sustained_fp8_matmul_efficiency", "dense_fp8_tflops > 0"),
    ({"sustained_matmul_efficiency": math.nan}, "sustained_matmul_efficiency", "got nan"),
]


@pytest.mark.parametrize("changes, field, expected", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
@pytest.mark.parametrize("where", ["catalogue", "cluster"])
def test_bad_gpu_figures_are_refused_with_one_line(runner, tiny, tmp_path, changes, field, expected, where):
    text = _gpu_toml(**changes)
    if where == "catalogue":
        files = tiny()
        bad = tmp_path / "gpus.toml"
        bad.write_text(text)
        options = ["--catalogue", str(bad)]
    else:
        files = tiny(cluster_extra="\n" + text)
        bad = files.cluster
        options = ["--cluster", str(bad)]
    out = tmp_path / "out.csv"
    result = _synth(runner, files, out, "--gpu", "A100", *options)
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and str(bad) in line and field in line and expected in line
    assert not out.exists()


def test_a_gpu_listed_twice_in_one_file_is_refused(tmp_path):
    path = tmp_path / "gpus.toml"
    path.write_text(_gpu_toml() + "\n" + _gpu_toml())
    with pytest.raises(Exception, match="listed twice"):
        load_gpu_specs(path)


def test_the_bundled_catalogue_passes_the_same_rules_and_has_the_added_gpus():
    specs = load_gpu_specs()
    assert {"RTX3090", "RTX4090", "L40S"} <= set(specs)
    assert all(spec.source and spec.date for spec in specs.values())



# -- a node type's memory from the catalogue --------------------------------------------------------------

def test_a_node_type_without_gpu_memory_takes_its_gpus_memory_from_the_catalogue(runner, tiny, tmp_path):
    files = tiny(nodes={"fast": {"gpu_memory_gib": None}}, cluster_extra="\n" + _gpu_toml(name="fast"))
    cluster = load_cluster(str(files.cluster))
    assert cluster.node_types["fast"].gpu_memory_gib == 24.0  # the file's own [[gpu]] table
    assert cluster.node_types["slow"].gpu_memory_gib == 16.0  # given, so the table is not needed
    output = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", *files.args("--output", str(output))])
    assert result.exit_code == 0, result.output
    plans = json.loads(output.read_text())
    capacities = {(stage["gpu"], stage["memory_capacity_gib"]) for plan in plans for stage in plan["stages"]}
    assert {c for gpu, c in capacities if gpu == "fast"} == {24.0}
    assert {c for gpu, c in capacities if gpu != "fast"} == {16.0}  # slow, and a stage of both takes the least


def test_the_bundled_catalogue_gives_the_memory_and_a_cluster_gpu_table_or_gpu_memory_gib_wins(tiny):
    bundled_a100 = load_gpu_specs()["A100"].memory_gib
    assert bundled_a100 == 39.59  # nvidia-smi memory.total of an A100-SXM4-40GB, 40536 MiB
    a100 = {"gpu": "A100", "gpu_memory_gib": None}
    assert load_cluster(str(tiny("bundled", nodes={"fast": a100}).cluster)).node_types["fast"].gpu_memory_gib \
        == bundled_a100
    own = tiny("own", nodes={"fast": a100}, cluster_extra="\n" + _gpu_toml(name="A100", memory_gib=30.0))
    assert load_cluster(str(own.cluster)).node_types["fast"].gpu_memory_gib == 30.0
    given = tiny("given", nodes={"fast": {"gpu": "A100", "gpu_memory_gib": 12.5}},
                 cluster_extra="\n" + _gpu_toml(name="A100", memory_gib=30.0))
    assert load_cluster(str(given.cluster)).node_types["fast"].gpu_memory_gib == 12.5


def test_a_missing_gpu_memory_of_a_gpu_in_no_catalogue_is_one_line(runner, tiny):
    files = tiny(nodes={"slow": {"gpu_memory_gib": None}})
    result = runner.invoke(main, ["search", *files.args()])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.output
    assert f"{files.cluster}: node_type.slow.gpu_memory_gib" in line and "'slow'" in line


def test_a_gpu_table_in_the_cluster_file_shapes_the_micro_batch_scaling_of_its_profile(runner, tiny):
    """The tiny profiles hold mbs 1 only: without a spec of "fast" larger micro-batches cost per sample, with
    the cluster's own table they follow its roofline, whose launches and weight reads do not grow. (The pipeline
    time is compared: the table's memory bandwidth also prices the optimizer step, which follows it.)"""
    plain, own = tiny("plain"), tiny("own", cluster_extra="\n" + _gpu_toml(name="fast"))
    steps = []
    for files in (plain, own):
        out = files.root / "plans.json"
        assert runner.invoke(main, ["search", *files.args(), "--output", str(out)]).exit_code == 0
        steps.append({(p["tp"], p["dp"], p["pp"], p["mbs"], tuple(p["placement"])): p["pipeline_time_s"]
                      for p in json.loads(out.read_text())})
    assert steps[0].keys() == steps[1].keys()
    uses_fast = [key for key in steps[0] if "fast" in key[4]]
    for key in uses_fast:
        if key[3] == 1:
            assert steps[1][key] == steps[0][key]
        else:
            assert steps[1][key] <= steps[0][key]
    assert any(steps[1][key] < steps[0][key] * (1 - 1e-3) for key in uses_fast if key[3] > 1)
