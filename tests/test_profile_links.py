"""`fasop profile links`: the alpha-beta fit, the bytes each link carries, and real runs on the processor (gloo)
whose fragments paste into a cluster file that fasop loads."""

import importlib.util
import math
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from fasop.cli import main
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.profile.links import fit_alpha_beta, group_nodes, launch_from_env, link_bytes, parse_message_sizes

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
SIZES = "16K,1M,16M"
FIELD = re.compile(r'^(intra|inter)_node_bandwidth = "([^"]+)"$', re.M)
LATENCY = re.compile(r"^#   (\w+)_latency_s = (\S+)$", re.M)


# -- the fit ----------------------------------------------------------------------------------------------
def test_fit_recovers_alpha_and_beta_of_exact_times():
    x = np.array([4e3, 6.4e4, 1e6, 1.6e7, 2.56e8])
    fit = fit_alpha_beta(x, 25e-6 + x / 12e9)
    assert fit.latency_s == pytest.approx(25e-6, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(12e9, rel=1e-6)
    assert fit.rms_relative_error < 1e-9


def test_fit_of_noisy_times_stays_close_and_never_goes_negative():
    x = np.geomspace(4e3, 2.56e8, 12)
    noise = np.random.default_rng(7).uniform(0.97, 1.03, len(x))
    fit = fit_alpha_beta(x, (8e-6 + x / 40e9) * noise)
    assert fit.latency_s == pytest.approx(8e-6, rel=0.1)
    assert fit.bytes_per_s == pytest.approx(40e9, rel=0.05)
    # times that fall with size would give a negative latency to plain least squares
    fit = fit_alpha_beta(np.array([1e3, 1e6]), np.array([1e-3, 2e-3]))
    assert fit.latency_s >= 0 and fit.bytes_per_s > 0


def test_fit_refuses_times_that_do_not_grow():
    with pytest.raises(InputError, match="do not grow"):
        fit_alpha_beta(np.array([1e3, 1e6]), np.array([2e-3, 1e-3]))


def test_link_bytes_are_what_the_cost_model_charges_one_link():
    nodes = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # 3 nodes of 4 GPUs
    assert link_bytes("p2p_intra_node", 1000, nodes) == 1000
    assert link_bytes("p2p_inter_node", 1000, nodes) == 4 * 1000  # 4 pairs share each interface
    assert link_bytes("allreduce_intra_node", 1000, nodes) == pytest.approx(2 * 3 / 4 * 1000)
    assert link_bytes("allreduce_inter_node", 1000, nodes) == pytest.approx(2 * 2 / 3 * 4 * 1000)


def test_ranks_are_grouped_by_node_and_launch_read_from_torchrun_or_slurm():
    assert group_nodes(["a#0", "a#0", "a#1", "a#1"]) == [[0, 1], [2, 3]]
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "MASTER_ADDR": "n0", "MASTER_PORT": "6000"}
    launch = launch_from_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.node_id) == (3, 4, 1, "1")
    with pytest.raises(InputError, match="torchrun or srun"):
        launch_from_env({})
    with pytest.raises(InputError, match="WORLD_SIZE"):
        launch_from_env({**env, "RANK": "0", "WORLD_SIZE": "x"})


def test_message_sizes():
    assert parse_message_sizes("1M,4K,4K") == (4096, 2**20)
    for bad in ("4K", "3", "1T", "4K,,1M", "-4K,1M"):
        with pytest.raises(InputError, match=f"^sizes_text={bad}: expected "):
            parse_message_sizes(bad)


def test_outside_a_launcher_the_command_says_so_in_one_line(runner, tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    result = runner.invoke(main, ["profile", "links", "--out", str(tmp_path / "links.toml")])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "torchrun or srun" in result.stderr
    assert not (tmp_path / "links.toml").exists()


# -- real runs on the processor -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fields(text: str) -> dict[str, str]:
    return {f"{link}_node_bandwidth": value for link, value in FIELD.findall(text)}


def _check_latencies(text: str, kinds: set[str]) -> None:
    latencies = dict(LATENCY.findall(text))
    assert set(latencies) == kinds
    assert all(math.isfinite(float(v)) and float(v) >= 0 for v in latencies.values())


@needs_torch
def test_two_processes_on_one_node_write_the_intra_node_field(tmp_path, tiny):
    out = tmp_path / "links.toml"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(_free_port()), "-m", "fasop", "profile", "links", "--device", "cpu",
                          "--sizes", SIZES, "--repeat", "5", "--warmup", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert "gloo" in text and "1 node(s) x 2 process(es)" in text
    fields = _fields(text)
    assert set(fields) == {"intra_node_bandwidth"}
    _check_latencies(text, {"p2p_intra_node", "allreduce_intra_node"})
    # pasted in place of a node type's own field, the cluster loads with the measured figure
    inputs = tiny(nodes={"slow": {"intra_node_bandwidth": None}}, cluster_extra=text)
    measured = load_cluster(str(inputs.cluster)).node_types["slow"].intra_node_bytes_per_s
    assert math.isfinite(measured) and measured > 0
    assert f"{measured / 1e9:.4f} GB/s" == fields["intra_node_bandwidth"] or measured < 1e8


@needs_torch
def test_two_nodes_of_two_processes_write_both_fields(tmp_path, tiny):
    """Four processes started as two torchrun agents would start them (GROUP_RANK 0 and 1, two local ranks
    each), all on this machine: the intra-node pairs and the inter-node pairs are both timed."""
    out = tmp_path / "links.toml"
    port = str(_free_port())
    processes = []
    for rank in range(4):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
               "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "fasop", "profile", "links", "--device", "cpu", "--sizes", SIZES, "--repeat", "5",
             "--warmup", "1", "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0] * 4, outputs
    text = out.read_text()
    assert "2 node(s) x 2 process(es)" in text
    assert set(_fields(text)) == {"intra_node_bandwidth", "inter_node_bandwidth"}
    _check_latencies(text, {"p2p_intra_node", "p2p_inter_node", "allreduce_intra_node", "allreduce_inter_node"})
    # the whole file appended after a node type without its bandwidths fills them in
    inputs = tiny(nodes={"slow": {"intra_node_bandwidth": None, "inter_node_bandwidth": None}}, cluster_extra=text)
    slow = load_cluster(str(inputs.cluster)).node_types["slow"]
    for value in (slow.intra_node_bytes_per_s, slow.inter_node_bytes_per_s):
        assert math.isfinite(value) and value > 0
    assert "cluster-file fields written" in outputs[0][0] and not any(o[0] for o in outputs[1:])


@needs_torch
def test_an_existing_output_is_kept_and_every_rank_ends(tmp_path):
    out = tmp_path / "links.toml"
    out.write_text("keep me\n")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(_free_port()), "-m", "fasop", "profile", "links", "--device", "cpu",
                          "--sizes", SIZES, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert run.stderr.count("already exists") == 1
    assert out.read_text() == "keep me\n"
