"""run_inter.sh's NCCL network settings: each node exports those of its own node type's fabric
(clusters/catalogue/fabrics.toml, with the cluster file's `network` names over them)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from fasop.files import comment_line
from fasop.inputs import bundled
from fasop.inputs.tomlfile import read_toml
from fasop.launch.shell import assignment, quote

SHARED_FABRIC = "ethernet"  # what nodes of different fabrics share: TCP sockets


@functools.cache
def fabric_defaults() -> dict[str, dict[str, str]]:
    """fabric -> {variable: value}, from the bundled fabrics.toml."""
    return read_toml(bundled.data_dir("clusters") / "catalogue" / "fabrics.toml")


def network_env(node_type: Any, fabric: str) -> dict[str, str]:
    """The variables a node of `node_type` exports when the job runs over `fabric`."""
    env = dict(fabric_defaults()[fabric])
    network = node_type.network
    if network.socket_ifname is not None:
        env["NCCL_SOCKET_IFNAME"] = network.socket_ifname
    if network.ib_hca is not None and fabric == "infiniband":
        env["NCCL_IB_HCA"] = network.ib_hca
    return env


def network_lines(node_types: Sequence[Any]) -> list[str]:
    """A `case` over this node's type exporting its fabric's variables; none for a node type without a
    `network` table (NCCL picks). Node types of different fabrics all use TCP sockets."""
    described = [t for t in node_types if t.network is not None]
    if not described:
        return []
    fabrics = {t.network.fabric for t in described}
    shared = len(fabrics) > 1
    lines = ["# NCCL network settings of this node's type (fabric defaults: clusters/catalogue/fabrics.toml)."]
    if shared:
        lines.append("# The plan's node types differ in fabric, so every node uses the one they share: TCP sockets.")
    unknown = [t.name for t in node_types if t.network is None]
    if unknown:
        lines.append(comment_line(f"No network table for {', '.join(unknown)}: NCCL picks its transport there, and "
                                  "every node of one job must use the same one."))
    lines.append('case "${NODE_TYPES[$NODE_RANK]}" in')
    for node_type in described:
        env = network_env(node_type, SHARED_FABRIC if shared else node_type.network.fabric)
        lines += [f"{quote(node_type.name)})",
                  "    export " + " ".join(assignment(k, v) for k, v in sorted(env.items())), "    ;;"]
    return [*lines, "esac", ""]
