"""NVLink domains that span nodes (a GB200 NVL72 rack: 18 trays of 4 GPUs): GPUs of one domain talk over NVLink
whether or not they share a node, domains talk through all their nodes' network interfaces; a node without such a
domain is its own, as before."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fasop.cost.communication import Links
from fasop.errors import InputError
from fasop.inputs import bundled
from fasop.inputs.cluster import load_cluster

NVLINK = 900e9  # the bundled cluster's per-GPU NVLink, one direction
NIC = 1600e9 / 8  # its per-tray network interface


def _trays(per_domain: int, count: int = 20):
    cluster = load_cluster("gb200-nvl72")
    node = replace(cluster.node_types["GB200"], nvlink_domain_nodes=per_domain, count=count)
    return replace(cluster, node_types={"GB200": node}), ("GB200",) * count


def test_the_catalogue_makes_a_gb200_tray_one_of_a_72_gpu_domain():
    node = load_cluster("gb200-nvl72").node_types["GB200"]
    assert (node.gpus_per_node, node.nvlink_domain_nodes) == (4, 18)
    assert load_cluster("h100-a100-a10g").node_types["H100"].nvlink_domain_nodes == 1


def test_trays_are_numbered_into_racks_in_placement_order():
    links = Links(*_trays(18))
    assert links.domain.tolist() == [0] * 18 + [1] * 2
    assert links.domain_inter.tolist() == [18 * NIC, 2 * NIC]  # a rack sends through every tray's interface
    assert Links(*_trays(1)).domain.tolist() == list(range(20))


def test_a_send_between_trays_of_one_rack_rides_nvlink():
    src, dst = np.array([[0]]), np.array([[1]])
    per_byte, _ = Links(*_trays(18)).exchange(src, dst)
    assert per_byte[0] == pytest.approx(1 / NVLINK)
    per_byte, _ = Links(*_trays(1)).exchange(src, dst)
    assert per_byte[0] == pytest.approx(1 / NIC)
    # into the other rack, whose 2 trays' interfaces receive it (NCCL's PXN moves a GPU's traffic to any NIC
    # of its NVLink domain), while the 18 of the sending rack share its sending
    per_byte, _ = Links(*_trays(18)).exchange(np.array([[0]]), np.array([[18]]))
    assert per_byte[0] == pytest.approx(1 / (2 * NIC))


def test_an_all_reduce_inside_a_rack_is_one_nvlink_ring():
    """8 GPUs on 2 trays of one rack: 2 (8 - 1) / 8 bytes per byte over NVLink; on trays of their own racks, a
    ring of 4 in each tray and 2 (2 - 1) / 2 across the two trays' interfaces."""
    groups = np.array([[[0, 0, 0, 0, 1, 1, 1, 1]]])
    rack, _ = Links(*_trays(18)).allreduce(groups)
    assert rack[0] == pytest.approx(2 * 7 / 8 / NVLINK)
    apart, _ = Links(*_trays(1)).allreduce(groups)
    assert apart[0] == pytest.approx(2 * 3 / 4 / NVLINK + 2 * 1 / 2 / NIC)


@pytest.mark.parametrize("domain, message", [(6, "multiple of the node's 4 GPUs"), (0, "from 1 to")])
def test_a_domain_of_part_of_a_node_is_refused(tmp_path, domain, message):
    text = (bundled.data_dir("clusters") / "gb200-nvl72.toml").read_text()
    path = tmp_path / "c.toml"
    path.write_text(text.replace("count = 36", f"count = 36\nnvlink_domain_gpus = {domain}"))
    with pytest.raises(InputError, match="nvlink_domain_gpus") as err:
        load_cluster(str(path))
    assert message in str(err.value)
