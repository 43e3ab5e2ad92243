"""The cluster description: node types, their GPUs, links, prices and how many are available."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from fasop.errors import InputError
from fasop.inputs import bundled
from fasop.inputs.names import table_name
from fasop.inputs.tomlfile import Table, read_toml

# Units a bandwidth may be written in, as bytes per second per unit. "Gb/s" and "Gbps" are refused: one
# capital letter apart from "GB/s", they are the classic way to be wrong by 8x.
_BANDWIDTH_UNITS = {
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
    "B/s": 1.0, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "GiB/s": 2.0**30,
}
MIN_BANDWIDTH_BYTES_PER_S, MAX_BANDWIDTH_BYTES_PER_S = 1e3, 1e15
_BANDWIDTH = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")


def parse_bandwidth(text: Any, where: str) -> float:
    """'40 Gbit/s' -> 5e9 (bytes per second)."""
    match = _BANDWIDTH.match(text) if isinstance(text, str) else None
    if not match or match.group(2) not in _BANDWIDTH_UNITS:
        units = ", ".join(_BANDWIDTH_UNITS)
        raise InputError(where, f"expected a bandwidth such as \"40 Gbit/s\" or \"230 GB/s\" (units: {units}), got {text!r}")
    value = float(match.group(1)) * _BANDWIDTH_UNITS[match.group(2)]
    if not MIN_BANDWIDTH_BYTES_PER_S <= value <= MAX_BANDWIDTH_BYTES_PER_S:  # also refuses inf ("1e999 GB/s")
        raise InputError(where, f"expected a bandwidth from 1 kB/s to 1 PB/s, got {text!r}")
    return value


@dataclass(frozen=True)
class NodeType:
    name: str
    gpu: str
    gpus_per_node: int
    gpu_memory_gib: float
    intra_node_bytes_per_s: float  # per GPU, between GPUs of one node
    inter_node_bytes_per_s: float  # per node, through its network interface
    price_per_hour_usd: float  # per node
    count: int
    instance: str = ""
    price_source: str = ""
    price_date: str = ""
    slurm_partition: str | None = None
    gres_type: str | None = None


@dataclass(frozen=True)
class Derating:
    """Achieved bandwidth = nominal / derating, for each kind of transfer and link."""

    p2p_intra_node: float = 1.0
    p2p_inter_node: float = 1.0
    collective_intra_node: float = 1.0
    collective_inter_node: float = 1.0


@dataclass(frozen=True)
class Cluster:
    name: str
    node_types: dict[str, NodeType]
    derating: Derating = Derating()
    memory_margin: float = 1.0
    description: str = ""
    launch: dict[str, Any] = field(default_factory=dict)
    file: str = ""
    gpus: dict[str, Any] = field(default_factory=dict)  # the file's own [[gpu]] specs (fasop.catalogue)

    @property
    def gpus_per_node(self) -> int:
        return next(iter(self.node_types.values())).gpus_per_node

    @property
    def num_nodes(self) -> int:
        return sum(t.count for t in self.node_types.values())

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def price_per_hour_usd(self) -> float:
        return sum(t.count * t.price_per_hour_usd for t in self.node_types.values())

    def with_counts(self, counts: dict[str, int]) -> "Cluster":
        """The same cluster with other node counts (node types at 0 are dropped)."""
        types = {n: replace(t, count=counts[n]) for n, t in self.node_types.items() if counts.get(n, 0) > 0}
        return replace(self, node_types=types)


# Ranges of the numbers of a cluster file (docs/formats.md): generous, but finite products of them stay finite.
MAX_GPUS_PER_NODE = 1024
MAX_GPU_MEMORY_GIB = 65536.0
MAX_PRICE_PER_HOUR_USD = 1e6
MAX_NODES_PER_TYPE = 1_000_000
MAX_DERATING = 1000.0
MAX_MEMORY_MARGIN = 100.0

_NODE_FIELDS = {
    "name", "gpu", "instance", "gpus_per_node", "gpu_memory_gib", "intra_node_bandwidth",
    "inter_node_bandwidth", "price_per_hour_usd", "price_source", "price_date", "count",
    "slurm_partition", "gres_type",
}


def _gpu_memory_gib(table: Table, gpu: str, catalogue: Callable[[], dict[str, Any]]) -> float:
    """The node type's gpu_memory_gib, or else the memory_gib of its GPU in the catalogue."""
    if "gpu_memory_gib" in table.data:
        return table.float("gpu_memory_gib", maximum=MAX_GPU_MEMORY_GIB)
    spec = catalogue().get(gpu)
    if spec is None:
        raise InputError(table.where("gpu_memory_gib"), f"missing, and GPU {gpu!r} is in neither the bundled "
                                                        "catalogue/gpus.toml nor this file's [[gpu]] tables")
    return spec.memory_gib


def _node_type(raw: Any, file: str, index: int, catalogue: Callable[[], dict[str, Any]]) -> NodeType:
    table = Table(raw, file, f"node_type[{index}]")
    table.reject_unknown(_NODE_FIELDS)
    name = table_name(table, "name")
    table.prefix = f"node_type.{name}"
    gpu = table_name(table, "gpu")  # checked before use: it also names the GPU's profile files
    return NodeType(
        name=name,
        gpu=gpu,
        gpus_per_node=table.int("gpus_per_node", maximum=MAX_GPUS_PER_NODE),
        gpu_memory_gib=_gpu_memory_gib(table, gpu, catalogue),
        intra_node_bytes_per_s=parse_bandwidth(table.data.get("intra_node_bandwidth"), table.where("intra_node_bandwidth")),
        inter_node_bytes_per_s=parse_bandwidth(table.data.get("inter_node_bandwidth"), table.where("inter_node_bandwidth")),
        price_per_hour_usd=table.float("price_per_hour_usd", minimum=0.0, strict=False, maximum=MAX_PRICE_PER_HOUR_USD),
        count=table.int("count", minimum=0, maximum=MAX_NODES_PER_TYPE),
        instance=table.str("instance", ""),
        price_source=table.str("price_source", ""),
        price_date=table.str("price_date", ""),
        slurm_partition=table.str("slurm_partition", required=False),
        gres_type=table.str("gres_type", required=False),
    )


def load_cluster(name_or_path: str) -> Cluster:
    """Load a cluster from a TOML file, or a bundled cluster by name (`fasop-1xA100-7xA10`, ...)."""
    path, is_bundled = bundled.locate("clusters", name_or_path, ".toml", "--cluster")
    raw = read_toml(path)
    file = str(path)
    for key in raw:
        if key not in ("cluster", "node_type", "launch", "gpu"):
            raise InputError(f"{file}: {key}", "unknown table (known: cluster, node_type, launch, gpu)")
    head = Table(raw.get("cluster"), file, "cluster")
    head.reject_unknown({"name", "description", "memory_margin", "derating"})
    derating_table = Table(head.data.get("derating", {}), file, "cluster.derating")
    derating_table.reject_unknown(set(Derating.__dataclass_fields__))
    derating = Derating(**{k: derating_table.float(k, 1.0, maximum=MAX_DERATING) for k in Derating.__dataclass_fields__})
    if not isinstance(raw.get("node_type"), list) or not raw["node_type"]:
        raise InputError(f"{file}: node_type", "expected at least one [[node_type]] table")
    from fasop.inputs.catalogue import gpu_tables, merged_specs  # they read bandwidths with parse_bandwidth, from here

    gpus = gpu_tables(raw["gpu"], file) if "gpu" in raw else {}
    # the bundled catalogue with the file's own GPUs over it, read only if a node type leaves out its memory
    catalogue = functools.cache(lambda: merged_specs(own=gpus))
    types: dict[str, NodeType] = {}
    for index, entry in enumerate(raw["node_type"]):
        node_type = _node_type(entry, file, index, catalogue)
        if node_type.name in types:
            raise InputError(f"{file}: node_type.{node_type.name}", "defined twice")
        types[node_type.name] = node_type
    sizes = {t.gpus_per_node for t in types.values()}
    if len(sizes) > 1:
        raise InputError(f"{file}: node_type.gpus_per_node",
                         f"all node types need the same GPUs per node (Megatron-LM gives every node the same number of ranks), got {sorted(sizes)}")
    if all(t.count == 0 for t in types.values()):
        raise InputError(f"{file}: node_type.count", "expected at least one available node")
    launch = raw.get("launch", {})
    if not isinstance(launch, dict):
        raise InputError(f"{file}: launch", "expected a table")
    return Cluster(
        name=table_name(head, "name"),
        node_types={n: t for n, t in types.items() if t.count > 0},
        derating=derating,
        memory_margin=head.float("memory_margin", 1.0, maximum=MAX_MEMORY_MARGIN),
        description=head.str("description", ""),
        launch=launch,
        file=name_or_path if is_bundled else file,
        gpus=gpus,
    )
