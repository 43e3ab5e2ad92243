"""Nodes holding several GPU kinds (`gpus` in a node type, clusters/workstations-4090-3090.toml): each kind a
block node type, stages on one kind's GPUs, boundaries between kinds of one node over its intra-node link, whole
nodes paid for, and FlagScale hostfiles whose labels and CUDA_VISIBLE_DEVICES put every rank where the plan
does."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_emit_flagscale import (
    SMOKE,
    hostfile_rows,
    manual_files,
    model_toml,
    plan_of,
    read_yaml,
    schema_errors,
)

from fasop.cli import main
from fasop.cost.stagegroups import host_labels, host_types, label_places, node_hosts
from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch.flagscale import flagscale_launcher_files, render_flagscale
from fasop.search.stagegroups import StageGroup, estimate_stage_groups, stage_group_spec

WORKSTATIONS = "workstations-4090-3090"
MIXED_TOML = """\
[cluster]
name = "mixed"
[[node_type]]
name = "ws"
gpus = [{{ gpu = "RTX4090", count = 2 }}, {{ gpu = "RTX3090", count = 2{kind} }}]
intra_node_bandwidth = "31.5 GB/s"
inter_node_bandwidth = "10 Gbit/s"
price_per_hour_usd = 2.0
count = 2
"""


def mixed(tmp_path: Path, kind: str = "", text: str | None = None):
    path = tmp_path / "mixed.toml"
    path.write_text(text or MIXED_TOML.format(kind=kind))
    return load_cluster(str(path))


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "llama-12.toml"
    path.write_text(model_toml(False))
    return load_model(str(path))


def test_each_kind_is_a_block_node_type_of_its_node(tmp_path):
    cluster = mixed(tmp_path, ', gpu_memory_gib = 23.5, intra_node_bandwidth = "56 GB/s"')
    fast, slow = cluster.node_types["ws.RTX4090"], cluster.node_types["ws.RTX3090"]
    assert list(cluster.node_types) == ["ws.RTX4090", "ws.RTX3090"] and list(cluster.hosts) == ["ws"]
    assert (fast.gpu, fast.gpus_per_node, fast.count, fast.host, fast.host_first_gpu) == ("RTX4090", 2, 2, "ws", 0)
    assert (slow.gpu, slow.host_first_gpu, slow.gpu_memory_gib) == ("RTX3090", 2, 23.5)
    assert fast.gpu_memory_gib == 23.99  # the catalogue's (clusters/catalogue/gpus.toml)
    assert fast.intra_node_bytes_per_s == 31.5e9 and slow.intra_node_bytes_per_s == 56e9
    assert fast.inter_node_bytes_per_s == slow.inter_node_bytes_per_s == 1.25e9
    assert fast.price_per_hour_usd == slow.price_per_hour_usd == 1.0 and cluster.hosts["ws"].price_per_hour_usd == 2.0
    assert cluster.num_gpus == 8 and not cluster.one_kind_per_node
    with pytest.raises(InputError, match="expected one GPU kind and count per node"):
        _ = cluster.gpus_per_node


@pytest.mark.parametrize("text, field, problem", [
    (MIXED_TOML.format(kind="").replace('name = "ws"', 'name = "ws"\ngpu = "A10"'), "node_type.ws.gpu",
     "given beside `gpus`"),
    (MIXED_TOML.format(kind="").replace('"RTX3090"', '"RTX4090"'), "node_type.ws.gpus", "each GPU kind once"),
    (MIXED_TOML.format(kind="").replace("gpus = [", "gpuz = ["), "node_type", "gpuz"),
    (MIXED_TOML.format(kind="").replace('gpus = [{ gpu = "RTX4090", count = 2 }, ', "gpus = ["), "node_type",
     "gpus"),
])
def test_bad_gpu_kinds_are_refused_in_one_line(tmp_path, text, field, problem):
    with pytest.raises(InputError, match=problem) as raised:
        mixed(tmp_path, text=text)
    assert field in str(raised.value) and "\n" not in str(raised.value)


def test_a_node_type_without_gpu_or_gpus_is_refused(tmp_path):
    text = MIXED_TOML.format(kind="").replace('gpus = [{ gpu = "RTX4090", count = 2 }, { gpu = "RTX3090", count = 2 }]',
                                                'gpus_per_node = 4')
    with pytest.raises(InputError, match=r"node_type\.ws\.gpu: missing"):
        mixed(tmp_path, text=text)


def test_blocks_join_the_node_before_them_in_kind_order(tmp_path):
    cluster = mixed(tmp_path)
    four, three = "ws.RTX4090", "ws.RTX3090"
    assert node_hosts(cluster, [four, three, four]) == [0, 0, 1]
    assert node_hosts(cluster, [four, four, three]) == [0, 1, 1]
    assert node_hosts(cluster, [three, four]) == [0, 1]  # the node's 4090s come first in its device order
    assert host_types(cluster, [four, three, four]) == ["ws", "ws"]


def test_a_plan_needing_more_nodes_than_there_are_is_refused(tmp_path, model):
    cluster = mixed(tmp_path)
    placement = ["ws.RTX3090", "ws.RTX4090", "ws.RTX3090", "ws.RTX4090"]  # nodes: 3090 | 4090 3090 | 4090
    stages = [StageGroup(name, 1, 2, 3) for name in placement]
    with pytest.raises(ArgumentError, match="takes 3 nodes of type ws, cluster mixed has 2"):
        stage_group_spec(model, cluster, placement=placement, stages=stages, mbs=1, gbs=16)


def test_a_boundary_between_kinds_of_one_node_stays_off_the_network(tmp_path, model):
    cluster = mixed(tmp_path)

    def plan(placement):
        stages = [StageGroup(name, 1, 2, 6) for name in placement]
        spec = stage_group_spec(model, cluster, placement=placement, stages=stages, mbs=1, gbs=16)
        return estimate_stage_groups(model, cluster, spec)

    inside = plan(["ws.RTX4090", "ws.RTX3090"])  # one node: PCIe between the kinds
    across = plan(["ws.RTX3090", "ws.RTX4090"])  # two nodes: the 10 Gbit/s network
    assert [s.nodes for s in inside.stages] == [[0], [1]] and inside.placement == ["ws.RTX4090", "ws.RTX3090"]
    activation = 2 * 2048 * 1024 * 2  # one global micro-batch of 2 samples, bf16
    # each GPU sends its half of the activation over its own PCIe link; the node's network carries all of it
    assert inside.stages[0].send_s == pytest.approx(activation / 2 / 31.5e9 + 3.4e-6, rel=1e-9)
    assert across.stages[0].send_s == pytest.approx(activation / 1.25e9 + 9.6e-6, rel=1e-9)
    # a node is rented whole: one node for the first plan, two for the second
    assert inside.cost_per_hour_usd == 2.0 and across.cost_per_hour_usd == 4.0


def test_search_needs_stage_groups_on_a_cluster_of_such_nodes():
    result = CliRunner().invoke(main, ["search", "--model", "gpt2-xl", "--cluster", WORKSTATIONS])
    assert result.exit_code == 2
    assert [line for line in result.stderr.splitlines() if line.startswith("Error")] == [
        "Error: workstations-4090-3090: node_type.gpus: every node holds several GPU kinds: only stage-group plans "
        "use them (--stage-groups)"]


def physical_gpus(rows, envs) -> list[tuple[int, int]]:
    """(host, CUDA device) of every physical rank: hosts in hostfile order, each running its slots on the first
    devices of its label's CUDA_VISIBLE_DEVICES (FlagScale's nproc: the least of slots and devices)."""
    gpus = []
    for host, (_, slots, label) in enumerate(rows):
        devices = [int(d) for d in str(envs[label]["CUDA_VISIBLE_DEVICES"]).split(",")]
        assert len(devices) == slots
        gpus += [(host, device) for device in devices]
    return gpus


def mesh_gpus(train, rows, envs) -> list[list[tuple[int, int]]]:
    """FlagScale's RankMapper: physical ranks sorted by their host label's first place in hetero_device_types,
    then by physical rank; mesh i takes the next tp x cp x dp x pp of them. The (host, device) of each mesh's
    ranks, in its rank order."""
    hetero = train["system"]["hetero"]
    types, flat = hetero["hetero_device_types"], hetero["hetero_process_meshes"]
    physical = physical_gpus(rows, envs)
    label = [rows[host][2] for host, _ in physical]
    logical = sorted(range(len(physical)), key=lambda rank: (types.index(label[rank]), rank))
    result, offset = [], 0
    for i in range(0, len(flat), 5):
        size = flat[i] * flat[i + 1] * flat[i + 3] * flat[i + 4]
        result.append([physical[rank] for rank in logical[offset:offset + size]])
        offset += size
    assert offset == len(physical)
    return result


def test_stage_groups_plan_on_the_workstations_and_emit_for_flagscale(tmp_path, model):
    runner = CliRunner()
    model_file = tmp_path / "llama-12.toml"
    plans = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", str(model_file), "--cluster", WORKSTATIONS, "--stage-groups",
                                  "--output", str(plans), "--top", "3"])
    assert result.exit_code == 0, result.output
    record = json.loads(plans.read_text())[0]
    cluster = load_cluster(WORKSTATIONS)
    assert record["kind"] == "stage-groups" and {cluster.node_types[n].host for n in record["placement"]} == {"ws"}
    assert len(set(record["placement"])) == 2  # both kinds
    out = tmp_path / "run"
    emitted = runner.invoke(main, ["emit", "--smoke-test", "--plans", str(plans), "--rank", "1", "--out", str(out),
                                   "--launcher", "manual", "--model", str(model_file)])
    assert emitted.exit_code == 0, emitted.output
    train = read_yaml((out / "train" / "fasop.yaml").read_text())
    experiment = read_yaml((out / "flagscale.yaml").read_text())["experiment"]
    envs = experiment["envs"]
    exported = experiment.get("cmds", {}).get("before_start", "").split("; ")
    rows = hostfile_rows((out / "hostfile").read_text())
    assert all(node_type == "ws" for node_type in
               [line.split(": ")[-1] for line in (out / "hostfile").read_text().splitlines() if "node rank" in line])
    assert schema_errors(train, model, [slots for _, slots, _ in rows]) == []
    labels = envs["device_type_specific"]
    meshes = mesh_gpus(train, rows, labels)
    # every GPU's rank once
    everyone = [gpu for mesh in meshes for gpu in mesh]
    assert len(everyone) == len(set(everyone)) == sum(s["tp"] * s["dp"] for s in record["stages"])
    kind_of = {device: name for name, t in cluster.node_types.items()
               for device in range(t.host_first_gpu, t.host_first_gpu + t.gpus_per_node)}
    flat = train["system"]["hetero"]["hetero_process_meshes"]
    stages = iter(record["stages"])
    for i, mesh in enumerate(meshes):
        tp, dp, pp = flat[5 * i], flat[5 * i + 3], flat[5 * i + 4]
        for s in range(pp):
            stage = next(stages)
            gpus = mesh[s * tp * dp:(s + 1) * tp * dp]
            # every stage's GPUs of one kind, its own, on the nodes the plan gives it
            assert {kind_of[device] for _, device in gpus} == {record["placement"][stage["nodes"][0]]}
            hosts = node_hosts(cluster, record["placement"])
            assert {host for host, _ in gpus} == {hosts[n] for n in stage["nodes"]}
            # every tensor group inside one node
            groups = np.array([host for host, _ in gpus]).reshape(dp, tp)
            assert (groups == groups[:, :1]).all()
    # device indices as nvidia-smi numbers them, on every host
    assert all(labels[label].get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" for _, _, label in rows) \
        or "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in exported


def test_a_host_takes_a_later_mesh_label_when_an_earlier_one_has_another_environment(tmp_path, model):
    cluster = mixed(tmp_path)
    # stage 0 on the 4090s of both nodes, stage 1 on the second node's 3090s: the first node runs GPUs 0,1, the
    # second 0,1,2,3, so the second node cannot share the first's label
    plan = plan_of([("ws.RTX4090", 1, 4, 6, [0, 1]), ("ws.RTX3090", 1, 2, 6, [2])])
    assert node_hosts(cluster, plan.placement) == [0, 1, 1]
    files = manual_files(plan, model, cluster, tmp_path)
    train = read_yaml(files["train/fasop.yaml"])
    rows = hostfile_rows(files["hostfile"])
    labels = read_yaml(files["flagscale.yaml"])["experiment"]["envs"]["device_type_specific"]
    assert [(slots, label) for _, slots, label in rows] == [(2, "ws.RTX4090"), (4, "ws.RTX3090")]
    assert schema_errors(train, model, [2, 4]) == []
    assert mesh_gpus(train, rows, labels) == [[(0, 0), (0, 1), (1, 0), (1, 1)], [(1, 2), (1, 3)]]


def test_labels_follow_flagscale_meshes_and_refuse_hosts_that_need_two_environments(tmp_path, model):
    assert label_places([("A", 4, 2), ("A", 4, 2), ("A", 2, 4), ("B", 4, 2), ("A", 4, 2)]) == [0, 0, 0, 2, 3]
    text = MIXED_TOML.format(kind="").replace("count = 2\n", "count = 3\n")
    cluster = mixed(tmp_path, text=text)
    # stage 0 on the 4090s of nodes 0 and 1, stage 1 on the 3090s of nodes 1 and 2: node 1 runs all four GPUs
    # and node 2 only its 3090s, yet both can only take stage 1's label
    placement = ["ws.RTX4090", "ws.RTX4090", "ws.RTX3090", "ws.RTX3090"]
    assert node_hosts(cluster, placement) == [0, 1, 1, 2]
    assert host_labels(cluster, placement, [0, 0, 1, 1]) is None
    plan = plan_of([("ws.RTX4090", 1, 4, 6, [0, 1]), ("ws.RTX3090", 1, 4, 6, [2, 3])], batch=4)
    with pytest.raises(InputError, match="FlagScale gives a host one label and every host of a label one environment"):
        manual_files(plan, model, cluster, tmp_path)


THREE_WORKSTATIONS_AND_A10 = MIXED_TOML.format(kind="").replace("count = 2\n", "count = 3\n") + """
[[node_type]]
name = "A10"
gpu = "A10"
gpus_per_node = 4
intra_node_bandwidth = "31.5 GB/s"
inter_node_bandwidth = "10 Gbit/s"
price_per_hour_usd = 2.0
count = 2
"""


def test_every_rank_lands_where_the_layout_puts_it(tmp_path, model):
    """Every pipeline of two or three stages, each on one or two blocks of one kind (tp 1), on three
    workstations and two A10 nodes: FlagScale's rank mapping of the emitted files runs each position's GPUs in
    pipeline order, or the emitter refuses exactly where host_labels finds no labels."""
    cluster = mixed(tmp_path, text=THREE_WORKSTATIONS_AND_A10)
    choices = [(name, blocks) for name in ("ws.RTX4090", "ws.RTX3090", "A10") for blocks in (1, 2)]
    checked = refused = 0
    for pp in (2, 3):
        for stages in itertools.product(choices, repeat=pp):
            rows, position = [], 0
            for name, blocks in stages:
                dp = cluster.node_types[name].gpus_per_node * blocks
                rows.append((name, 1, dp, 12 // pp, list(range(position, position + blocks))))
                position += blocks
            placement = [name for name, blocks in stages for _ in range(blocks)]
            used = Counter(host_types(cluster, placement))
            if used["ws"] > 3 or used["A10"] > 2:
                continue
            plan = plan_of(rows, gbs=16, batch=8)
            labels = label_places([(name, 1, dp) for name, _, dp, _, _ in rows])
            position_label = [labels[s] for s, (_, blocks) in enumerate(stages) for _ in range(blocks)]
            if host_labels(cluster, placement, position_label) is None:
                with pytest.raises(InputError, match="no labels give each node"):
                    manual_files(plan, model, cluster, tmp_path)
                refused += 1
                continue
            files = manual_files(plan, model, cluster, tmp_path)
            train, rows_ = read_yaml(files["train/fasop.yaml"]), hostfile_rows(files["hostfile"])
            envs = read_yaml(files["flagscale.yaml"])["experiment"]["envs"]["device_type_specific"]
            assert schema_errors(train, model, [slots for _, slots, _ in rows_]) == []
            hosts = node_hosts(cluster, placement)
            expected = [(hosts[p], device) for p, name in enumerate(placement)
                        for device in range(cluster.node_types[name].host_first_gpu,
                                            cluster.node_types[name].host_first_gpu
                                            + cluster.node_types[name].gpus_per_node)]
            assert [gpu for mesh in mesh_gpus(train, rows_, envs) for gpu in mesh] == expected, stages
            checked += 1
    assert checked > 100 and refused > 0


def test_slurm_and_ssh_name_a_node_holding_several_kinds_by_its_node_type(tmp_path, model):
    cluster = mixed(tmp_path)
    plan = plan_of([("ws.RTX4090", 1, 2, 4, [0]), ("ws.RTX3090", 1, 2, 4, [1]), ("ws.RTX4090", 1, 2, 4, [2])],
                   batch=2)
    files = render_flagscale(plan, model, cluster, SMOKE)
    sbatch = files["sbatch.sh"]
    # Slurm allocates both nodes whole, as untyped GPUs; the hostfile runs four GPUs on one and two on the other
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gres=gpu:4" in sbatch and "hetjob" not in sbatch
    assert "NODE_SLOTS=(4 2)" in sbatch and "NODE_LABELS=(ws.RTX4090 ws.RTX4090_2)" in sbatch
    site = {"launcher": "ssh", "hosts_file": None, "rendezvous": "tcp", "rendezvous_file": None}
    ssh = flagscale_launcher_files(files, plan, cluster, tmp_path / "run", SMOKE, site)
    assert [line.split()[-1] for line in ssh["hosts"].splitlines() if not line.startswith("#")] == ["ws", "ws"]
    assert "NODE_TYPES=(ws ws)" in ssh["launch.sh"]
