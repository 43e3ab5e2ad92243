"""fasop emit for stage-group plans: FlagScale's heterogeneous-training configs and launchers, checked against
FlagScale's own rules (its pre_validate_args and RankMapper, re-implemented here from their description) and
run with stand-ins for scontrol, ssh and FlagScale's run.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import llama_toml

from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch.flagscale import flagscale_errors, flagscale_launcher_files, flagscale_meshes, render_flagscale
from fasop.launch.options import LaunchOptions, launch_options
from fasop.launch.yamltext import yaml_text
from fasop.plans import Plan

CLUSTER_TOML = """\
[cluster]
name = "three-types"
{extra}
[[node_type]]
name = "H100"
gpu = "H100"
gpus_per_node = 8
intra_node_bandwidth = "900 GB/s"
inter_node_bandwidth = "400 Gbit/s"
price_per_hour_usd = 30.0
count = 2
network = {{ fabric = "infiniband", ib_hca = "mlx5_0:1", socket_ifname = "ib0" }}

[[node_type]]
name = "A100"
gpu = "A100"
gpus_per_node = 8
intra_node_bandwidth = "600 GB/s"
inter_node_bandwidth = "200 Gbit/s"
price_per_hour_usd = 15.0
count = 1

[[node_type]]
name = "A10G"
gpu = "A10G"
gpus_per_node = 4
intra_node_bandwidth = "64 GB/s"
inter_node_bandwidth = "50 Gbit/s"
price_per_hour_usd = 5.0
count = 2
network = {{ fabric = "ethernet", socket_ifname = "eth0" }}
"""



def model_toml(tied: bool, **changes: Any) -> str:
    return llama_toml(**{"name": "llama-12", "num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16,
                         "num_query_groups": 4, "ffn_hidden_size": 2816, "tie_embeddings": tied,
                         "global_batch_size": 16, **changes})


SMOKE = LaunchOptions(smoke_test=True)


def cluster_of(path: Path, text: str):
    """The cluster of `text`: 4-GPU A10G nodes beside 8-GPU ones."""
    path.write_text(text)
    return load_cluster(str(path))


@pytest.fixture
def cluster(tmp_path):
    return cluster_of(tmp_path / "three-types.toml", CLUSTER_TOML.format(extra=""))


def model_of(tmp_path: Path, tied: bool = False):
    path = tmp_path / f"llama-{tied}.toml"
    path.write_text(model_toml(tied))
    return load_model(str(path))


@pytest.fixture
def model(tmp_path):
    return model_of(tmp_path)


def stage(index: int, gpu: str, tp: int, dp: int, mbs: int, layers: int, nodes: list[int]) -> dict[str, Any]:
    return {"stage": index, "gpu": gpu, "tp": tp, "dp": dp, "mbs": mbs, "layers": layers, "nodes": nodes,
            "compute_s": 1.0, "p2p_s": 0.0, "dp_allreduce_s": 0.0, "memory_gib": 1.0, "memory_capacity_gib": 80.0}


# (node type, tp, dp, layers, nodes) of each stage; the global micro-batch is 4 (first stage: dp 2 x mbs 2)
THREE_TYPES = [("H100", 4, 2, 4, [0]), ("H100", 4, 2, 3, [1]), ("A100", 2, 4, 3, [2]), ("A10G", 4, 2, 2, [3, 4])]
ABA = [("H100", 4, 2, 4, [0]), ("A10G", 4, 2, 4, [1, 2]), ("H100", 4, 2, 4, [3])]


def plan_of(rows, gbs: int = 16, batch: int = 4, **fields: Any) -> Plan:
    placement = [name for name, *_, nodes in rows for _ in nodes]
    stages = [stage(i, name, tp, dp, max(1, batch // dp), layers, nodes) for i, (name, tp, dp, layers, nodes) in enumerate(rows)]
    record = {"rank": 1, "kind": "stage-groups", "gbs": gbs, "mbs": batch // rows[0][2], "tp": rows[0][1],
              "dp": rows[0][2], "pp": len(rows), "placement": placement, "layers_per_stage": [r[3] for r in rows],
              "distributed_optimizer": True, "sequence_parallel": True, "recompute": "full",
              "recompute_method": "uniform", "recompute_num_layers": 1, "stages": stages, **fields}
    return Plan.model_validate(record)


# -- a reader of the YAML the emitter writes (block mappings and lists, flow lists, JSON-quoted strings) ---------
def _value(text: str) -> Any:
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return [_value(item) for item in re.findall(r'"(?:[^"\\]|\\.)*"|[^,\s][^,]*', text[1:-1])]
    if text.startswith('"'):
        import json
        return json.loads(text)
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"true": True, "false": False, "null": None, "{}": {}}.get(text, text)


def read_yaml(text: str) -> Any:
    lines = [(len(line) - len(line.lstrip(" ")), line.strip()) for line in text.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]

    def block(start: int, indent: int) -> tuple[Any, int]:
        if lines[start][1].startswith("- "):
            items = []
            while start < len(lines) and lines[start][0] == indent and lines[start][1].startswith("- "):
                rest = lines[start][1][2:]
                if re.match(r'[\w"][^:]*:( |$)', rest):  # a mapping item: its first key on the dash's line
                    lines[start] = (indent + 2, rest)
                    item, start = block(start, indent + 2)
                else:
                    item, start = _value(rest), start + 1
                items.append(item)
            return items, start
        mapping: dict[str, Any] = {}
        while start < len(lines) and lines[start][0] == indent:
            key, _, rest = lines[start][1].partition(":")
            key = _value(key)
            if rest.strip():
                mapping[key], start = _value(rest), start + 1
            else:
                mapping[key], start = block(start + 1, lines[start + 1][0])
        return mapping, start

    return block(0, 0)[0]


def test_yaml_text_reads_back():
    data = {"a": {"b": [1, 2, 3], "c": "word", "d": "two words", "e": True, "f": None, "g": "yes", "h": "0,1",
                  "i": "${x}/y", "j": []},
            "defaults": [{"train": "fasop"}, "_self_"], "k": -3, "nested": [{"x": 1, "y": {"z": "q"}}]}
    text = yaml_text(data)
    assert read_yaml(text) == data
    assert 'g: "yes"' in text and "e: true" in text and "b: [1, 2, 3]" in text  # YAML 1.1's booleans quoted
    assert "defaults:\n  - train: fasop\n  - _self_\n" in text


# -- FlagScale's rules (its arguments.py pre_validate_args, parallel_context.py), written from their description ---
def schema_errors(train: dict[str, Any], model: Any, slots: list[int]) -> list[str]:
    """The rules `train` breaks, by name."""
    system, hetero, shape = train["system"], train["system"]["hetero"], train["model"]
    flat = hetero["hetero_process_meshes"]
    meshes = [flat[i:i + 5] for i in range(0, len(flat), 5)]  # tp, cp, ep, dp, pp
    first, last = meshes[0], meshes[-1]
    small, large = sorted((first[3], last[3]))
    tied = not shape.get("untie_embeddings_and_output_weights", False)
    partial_ok = (first[3] == last[3] or not system.get("use_distributed_optimizer") or
                  (large % small == 0 and hetero.get("use_partial_reduce_for_shared_embedding", False)))
    split, types = hetero["hetero_pipeline_layer_split"], hetero["hetero_device_types"]
    checks = {
        "meshes of 5 numbers, hetero enabled": hetero.get("enable_hetero") and len(flat) % 5 == 0,
        "dp0 x mbs divisible by every mesh's dp": all(first[3] * shape["micro_batch_size"] % m[3] == 0 for m in meshes),
        "cp = 1": all(m[1] == 1 for m in meshes),
        "pp = the meshes' pp": system["pipeline_model_parallel_size"] == sum(m[4] for m in meshes),
        "no standalone embedding stage": not hetero.get("standalone_embedding_stage", False),
        "tied embeddings: tp": not tied or first[0] == last[0],
        "tied embeddings: partial reduce": not tied or partial_ok,
        "no virtual pipeline": "num_layers_per_virtual_pipeline_stage" not in shape,
        "layer split": sum(split) == shape["num_layers"] == model.num_layers and len(split) == system[
            "pipeline_model_parallel_size"],
        "device types": len(types) == len(meshes) and hetero["hetero_current_device_type"] in types,
        "world size": sum(m[0] * m[1] * m[3] * m[4] for m in meshes) == sum(slots),
        "expert groups": all((m[0] * m[1] * m[3] * m[4]) % (m[2] * m[4]) == 0 for m in meshes),
    }
    return [name for name, ok in checks.items() if not ok]


def hostfile_rows(text: str) -> list[tuple[str, int, str]]:
    rows = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            match = re.fullmatch(r"(\S+) slots=(\d+) type=(\S+)", line)
            assert match, line
            rows.append((match[1], int(match[2]), match[3]))
    assert len({host for host, _, _ in rows}) == len(rows)
    return rows


def mesh_nodes(train: dict[str, Any], rows: list[tuple[str, int, str]]) -> list[set[int]]:
    """FlagScale's RankMapper: ranks sorted by their label's first index in hetero_device_types, then by physical
    rank (hostfile order); mesh i takes the next tp x dp x pp of them. The nodes each mesh lands on."""
    types = train["system"]["hetero"]["hetero_device_types"]
    physical = [(node, label) for node, (_, slots, label) in enumerate(rows) for _ in range(slots)]
    logical = sorted(range(len(physical)), key=lambda rank: (types.index(physical[rank][1]), rank))
    flat = train["system"]["hetero"]["hetero_process_meshes"]
    result, offset = [], 0
    for i in range(0, len(flat), 5):
        size = flat[i] * flat[i + 1] * flat[i + 3] * flat[i + 4]
        result.append({physical[rank][0] for rank in logical[offset:offset + size]})
        offset += size
    return result


def manual_files(plan, model, cluster, tmp_path, options=SMOKE, hosts=None):
    site = {"launcher": "manual", "hosts_file": hosts, "rendezvous": "tcp", "rendezvous_file": None}
    return flagscale_launcher_files(render_flagscale(plan, model, cluster, options), plan, cluster, tmp_path / "run",
                                    options, site)


def test_three_node_types_render_and_pass_flagscale_rules(tmp_path, model, cluster):
    plan = plan_of(THREE_TYPES)
    files = manual_files(plan, model, cluster, tmp_path)
    train = read_yaml(files["train/fasop.yaml"])
    experiment = read_yaml(files["flagscale.yaml"])
    hetero = train["system"]["hetero"]
    assert hetero["hetero_process_meshes"] == [4, 1, 1, 2, 2, 2, 1, 1, 4, 1, 4, 1, 1, 2, 1]
    assert hetero["hetero_device_types"] == ["H100", "A100", "A10G"]
    assert hetero["hetero_pipeline_layer_split"] == [4, 3, 3, 2]
    rows = hostfile_rows(files["hostfile"])
    assert [(slots, label) for _, slots, label in rows] == [(8, "H100"), (8, "H100"), (8, "A100"), (4, "A10G"),
                                                            (4, "A10G")]
    assert schema_errors(train, model, [slots for _, slots, _ in rows]) == []
    assert mesh_nodes(train, rows) == [{0, 1}, {2}, {3, 4}]
    assert train["model"]["micro_batch_size"] == 2 and train["model"]["global_batch_size"] == 16
    assert train["model"]["untie_embeddings_and_output_weights"] is True and train["model"]["num_layers"] == 12
    assert train["system"]["recompute"] == {"recompute_granularity": "full", "recompute_method": "uniform",
                                            "recompute_num_layers": 1}
    assert train["system"]["checkpoint"]["ckpt_format"] == "torch"
    assert train["system"]["precision"] == {"bf16": True}
    runner = experiment["experiment"]["runner"]
    assert (runner["nnodes"], runner["nproc_per_node"], runner["rdzv_backend"]) == (5, 8, "static")
    assert experiment["defaults"] == [{"train": "fasop"}, "_self_"]
    envs = experiment["experiment"]["envs"]["device_type_specific"]
    assert envs["A10G"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and envs["H100"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    # node types of different fabrics all use TCP sockets: no InfiniBand device list
    assert envs["H100"]["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in envs["H100"]
    assert envs["A10G"]["NCCL_SOCKET_IFNAME"] == "eth0" and "NCCL_SOCKET_IFNAME" not in envs["A100"]
    assert envs["H100"]["NCCL_SOCKET_IFNAME"] == "ib0"


def test_non_contiguous_types_get_labels_of_their_own(tmp_path, model, cluster):
    plan = plan_of(ABA, gbs=8)
    assert [m.label for m in flagscale_meshes(plan)] == ["H100", "A10G", "H100_2"]
    hosts = tmp_path / "hosts"
    hosts.write_text("n0 H100\nn1 A10G\nn2 A10G\nn3 H100\n")
    files = manual_files(plan, model, cluster, tmp_path, hosts=str(hosts))
    train = read_yaml(files["train/fasop.yaml"])
    rows = hostfile_rows(files["hostfile"])
    assert rows == [("n0", 8, "H100"), ("n1", 4, "A10G"), ("n2", 4, "A10G"), ("n3", 8, "H100_2")]
    assert mesh_nodes(train, rows) == [{0}, {1, 2}, {3}]
    assert schema_errors(train, model, [8, 4, 4, 8]) == []
    # one label for both H100 meshes would give the A10G mesh H100 ranks: the check above can fail
    merged = [(host, slots, label.removesuffix("_2")) for host, slots, label in rows]
    train["system"]["hetero"]["hetero_device_types"] = ["H100", "A10G", "H100"]
    assert mesh_nodes(train, merged) != [{0}, {1, 2}, {3}]


def test_tied_embeddings_need_equal_tp_first_and_last(tmp_path, cluster):
    tied = model_of(tmp_path, tied=True)
    rows = [("H100", 4, 2, 6, [0]), ("A10G", 2, 4, 6, [1, 2])]
    errors = flagscale_errors(plan_of(rows, gbs=8), tied)
    assert len(errors) == 1 and "tied embeddings need the first and last stage's tp equal" in errors[0]
    with pytest.raises(InputError, match="FlagScale cannot run it: tied embeddings"):
        render_flagscale(plan_of(rows, gbs=8), tied, cluster, SMOKE)
    assert flagscale_errors(plan_of(rows, gbs=8), model_of(tmp_path)) == []


def test_tied_embeddings_with_different_dp_reduce_partially(tmp_path, cluster):
    tied = model_of(tmp_path, tied=True)
    plan = plan_of([("H100", 4, 2, 6, [0]), ("A10G", 4, 2, 6, [1, 2])], gbs=8)  # dp 2 and 2: no partial reduce
    assert "use_partial_reduce_for_shared_embedding" not in render_flagscale(plan, tied, cluster, SMOKE)[
        "train/fasop.yaml"]
    plan = plan_of([("H100", 2, 4, 6, [0]), ("A10G", 2, 2, 6, [1])], gbs=8)
    train = read_yaml(render_flagscale(plan, tied, cluster, SMOKE)["train/fasop.yaml"])
    assert train["system"]["hetero"]["use_partial_reduce_for_shared_embedding"] is True
    assert schema_errors(train, tied, [8, 4]) == []


def test_virtual_stages_and_batch_splits_are_refused(model, cluster):
    assert any("virtual" in e for e in flagscale_errors(plan_of(THREE_TYPES, virtual_stages=2), model))
    odd = plan_of([("H100", 8, 1, 6, [0]), ("A10G", 2, 2, 6, [1])], batch=1, gbs=4)  # dp0 x mbs = 1, dp 2
    assert any("not divisible by stage 1's dp 2" in e for e in flagscale_errors(odd, model))
    assert any("gbs 18" in e for e in flagscale_errors(plan_of(THREE_TYPES, gbs=18), model))
    short = plan_of([("H100", 4, 2, 4, [0]), ("A10G", 4, 2, 4, [1, 2])])
    assert any("sums to 8" in e for e in flagscale_errors(short, model))
    with pytest.raises(InputError, match="virtual_stages is 2"):
        render_flagscale(plan_of(THREE_TYPES, virtual_stages=2), model, cluster, SMOKE)


def test_stages_must_follow_node_rank_order_on_whole_nodes(model, cluster):
    swapped = plan_of([("H100", 4, 2, 6, [1]), ("H100", 4, 2, 6, [0])])
    assert any("must take node ranks 0 and on" in e for e in flagscale_errors(swapped, model))
    partial = plan_of([("H100", 2, 2, 6, [0]), ("A10G", 2, 2, 6, [1])])  # 4 GPUs of an 8-GPU node
    with pytest.raises(InputError, match="does not fill whole nodes of 8 GPUs"):
        render_flagscale(partial, model, cluster, SMOKE)


def test_encoder_decoder_models_are_refused(tmp_path, cluster):
    path = tmp_path / "t5.toml"
    path.write_text(model_toml(False, architecture="encoder-decoder", num_layers=None, encoder_num_layers=6,
                               decoder_num_layers=6, seq_length=None, encoder_seq_length=512, decoder_seq_length=128))
    assert any("GPT-style" in e for e in flagscale_errors(plan_of(THREE_TYPES), load_model(str(path))))


def test_output_is_byte_identical(tmp_path, model, cluster):
    plan = plan_of(THREE_TYPES, train_steps=1000, step_time_s=1.0)
    options = launch_options(None, data_path="corpus_text_document", tokenizer_type="GPT2BPETokenizer",
                             vocab_file="vocab.json", merge_file="merges.txt", training={"lr": "3e-4"})
    first = render_flagscale(plan, model, cluster, options)
    assert first == render_flagscale(plan, model, cluster, options)
    train = read_yaml(first["train/fasop.yaml"])
    assert train["data"]["data_path"] == "corpus_text_document" and train["model"]["train_iters"] == 1000
    assert train["system"]["checkpoint"]["exit_signal_handler"] is True
    assert "+train.system.exit_duration_in_mins=50" in first["sbatch.sh"]


def test_unsafe_words_never_reach_flagscale(tmp_path, model, cluster):
    for options in (launch_options(None, smoke_test=True, data_path="a b"),
                    launch_options(None, smoke_test=True, extra_flags=["--foo", "$(touch x)"])):
        with pytest.raises(InputError, match="FlagScale's runner writes it into a shell command unquoted"):
            render_flagscale(plan_of(THREE_TYPES), model, cluster, options)
    with pytest.raises(ArgumentError, match="flagscale_dir"):
        launch_options(None, flagscale_dir="Flag Scale;rm")
    with pytest.raises(ArgumentError, match="out_dir"):
        manual_files(plan_of(THREE_TYPES), model, cluster, tmp_path / "a b")
    hostile = cluster_of(tmp_path / "c.toml", CLUSTER_TOML.format(extra="").replace('"eth0"', '"^lo,docker"'))
    with pytest.raises(InputError, match="NCCL_SOCKET_IFNAME"):
        render_flagscale(plan_of(THREE_TYPES), model, hostile, SMOKE)


# -- the launchers, run with stand-ins ---------------------------------------------------------------------------
def stand_ins(directory: Path) -> dict[str, str]:
    """scontrol printing each component's hosts, ssh saying no node trains, python recording run.py's arguments."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", 'shift 2; tr , "\\n" <<< "$1"'), ("ssh", "exit 1"),
                       ("python", 'printf "%s\\n" "$PWD" "$@" > "$RECORD"')):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(directory / "record")}


def test_sbatch_writes_the_hostfile_from_the_allocation(tmp_path, model, cluster):
    run = tmp_path / "run"
    run.mkdir()
    (run / "FlagScale").mkdir()
    (run / "FlagScale" / "run.py").write_text("")
    plan = plan_of(THREE_TYPES)
    for name, text in render_flagscale(plan, model, cluster, SMOKE).items():
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_text(text)
    env = {**stand_ins(tmp_path), "SLURM_JOB_NODELIST_HET_GROUP_0": "h0,h1", "SLURM_JOB_NODELIST_HET_GROUP_1": "a0",
           "SLURM_JOB_NODELIST_HET_GROUP_2": "g0,g1"}
    result = subprocess.run(["bash", str(run / "sbatch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = hostfile_rows((run / "hostfile").read_text())
    assert rows == [("h0", 8, "H100"), ("h1", 8, "H100"), ("a0", 8, "A100"), ("g0", 4, "A10G"), ("g1", 4, "A10G")]
    assert mesh_nodes(read_yaml((run / "train" / "fasop.yaml").read_text()), rows) == [{0, 1}, {2}, {3, 4}]
    record = (tmp_path / "record").read_text().splitlines()
    assert record[:6] == [str(run / "FlagScale"), "run.py", "--config-path", str(run), "--config-name", "flagscale"]
    assert record[6:] == ["action=run", f"experiment.exp_dir={run}", f"experiment.runner.hostfile={run}/hostfile",
                          f"train.system.checkpoint.save={run}/checkpoints",
                          f"train.system.checkpoint.load={run}/checkpoints"]
    sbatch = (run / "sbatch.sh").read_text()
    assert sbatch.count("#SBATCH hetjob") == 2 and "--gres=gpu:a10g:4" in sbatch and "--gres=gpu:h100:8" in sbatch


def test_launch_sh_reads_the_hosts_file(tmp_path, model, cluster):
    plan = plan_of(ABA, gbs=8)
    site = {"launcher": "ssh", "hosts_file": None, "rendezvous": "tcp", "rendezvous_file": None}
    options = LaunchOptions(smoke_test=True, flagscale_dir=str(tmp_path / "fs"))
    (tmp_path / "fs").mkdir()
    (tmp_path / "fs" / "run.py").write_text("")
    run = tmp_path / "run"
    files = flagscale_launcher_files(render_flagscale(plan, model, cluster, options), plan, cluster, run, options, site)
    assert "sbatch.sh" not in files and "<host-0>" in files["hosts"]
    for name, text in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    (run / "hosts").write_text("u@n0 H100\nn1 A10G\nn2 A10G\nn3 H100\n")
    env = stand_ins(tmp_path)
    result = subprocess.run(["bash", str(run / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert hostfile_rows((run / "hostfile").read_text())[-1] == ("n3", 8, "H100_2")
    (run / "hosts").write_text("n0 H100\nn1 H100\n")
    result = subprocess.run(["bash", str(run / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "node type H100, but the plan places A10G at node rank 1" in result.stderr
    (run / "hosts").write_text("n0 H100\nn1 A10G\nN1 A10G\nn3 H100\n")  # FlagScale lists each host once
    result = subprocess.run(["bash", str(run / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "line 3: host N1 is on line 2 too" in result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_pass_shellcheck(tmp_path, model, cluster):
    plan = plan_of(THREE_TYPES, train_steps=100, step_time_s=1.0)
    options = launch_options(None, data_path="corpus", tokenizer_type="NullTokenizer", training={"lr": "1e-4"})
    slurm = render_flagscale(plan, model, cluster, options)
    site = {"launcher": "ssh", "hosts_file": None, "rendezvous": "tcp", "rendezvous_file": None}
    ssh = flagscale_launcher_files(render_flagscale(plan, model, cluster, SMOKE), plan, cluster, tmp_path, SMOKE, site)
    for name, text in (("sbatch.sh", slurm["sbatch.sh"]), ("launch.sh", ssh["launch.sh"])):
        path = tmp_path / name
        path.write_text(text)
        result = subprocess.run(["shellcheck", "--severity=style", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_other_rendezvous_and_hosts_with_slurm_are_refused(tmp_path, model, cluster):
    plan = plan_of(THREE_TYPES)
    files = render_flagscale(plan, model, cluster, SMOKE)
    for site, argument in (({"launcher": "ssh", "hosts_file": None, "rendezvous": "file", "rendezvous_file": "/x"},
                            "rendezvous"),
                           ({"launcher": "slurm", "hosts_file": "hosts", "rendezvous": "tcp", "rendezvous_file": None},
                            "hosts_file")):
        with pytest.raises(ArgumentError) as caught:
            flagscale_launcher_files(files, plan, cluster, tmp_path, SMOKE, site)
        assert caught.value.argument == argument


def test_emit_restates_a_three_type_plan_of_a_bundled_cluster(tmp_path):
    """fasop.emit of a stage-group plan on the bundled h100-a100-a10g cluster: estimated afresh, then written
    as FlagScale's files; a plan file whose step time was edited is refused as stale."""
    import warnings

    from fasop.errors import InputError
    from fasop.inputs.cluster import load_cluster
    from fasop.inputs.model import load_model
    from fasop.launch.write import emit
    from fasop.search.stagegroups import StageGroup, estimate_stage_groups, stage_group_spec

    model = load_model("llama2-7b")
    cluster = load_cluster("h100-a100-a10g").with_counts({"H100": 1, "A100": 2, "A10G": 2})
    spec = stage_group_spec(model, cluster, placement=["H100", "A100", "A100", "A10G", "A10G"],
                            stages=[StageGroup("H100", 8, 1, 10), StageGroup("A100", 4, 4, 14),
                                    StageGroup("A10G", 4, 4, 8)], mbs=4)
    plan = estimate_stage_groups(model, cluster, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the smoke test's run notes
        written = emit(plan, model, cluster, tmp_path / "run", smoke_test=True)
    names = {path.name for path in written}
    assert {"flagscale.yaml", "sbatch.sh", "plan.json"} <= names
    meshes = (tmp_path / "run" / "train" / "fasop.yaml").read_text()
    assert "hetero_process_meshes: [8, 1, 1, 1, 1, 4, 1, 1, 4, 1, 4, 1, 1, 4, 1]" in meshes
    stale = plan.model_copy(update={"step_time_s": plan.step_time_s * 2})
    with pytest.raises(InputError, match="stale plan"):
        emit(stale, model, cluster, tmp_path / "stale", smoke_test=True)
