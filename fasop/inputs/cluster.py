"""The cluster description: node types, their GPUs, links, prices and how many are available."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from fasop.errors import InputError
from fasop.inputs import bundled
from fasop.inputs.names import Name
from fasop.inputs.tomlfile import Range, Table, Text, read_toml, validated

# Units a bandwidth may be written in, as bytes per second per unit. "Gb/s" and "Gbps" are refused: one
# capital letter apart from "GB/s", they are the classic way to be wrong by 8x.
_BANDWIDTH_UNITS = {
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
    "B/s": 1.0, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "GiB/s": 2.0**30,
}
MIN_BANDWIDTH_BYTES_PER_S, MAX_BANDWIDTH_BYTES_PER_S = 1e3, 1e15
# Latency of one step of a transfer, microseconds: NCCL's own tuning model (src/graph/tuning.cc, hwLat, ring
# algorithm with the Simple protocol, which large transfers use) charges 3.4 us per NVLink hop and 9.6 us per
# network hop.
DEFAULT_INTRA_NODE_LATENCY_US = 3.4
DEFAULT_INTER_NODE_LATENCY_US = 9.6
MAX_LATENCY_US = 1e6
_BANDWIDTH = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")


def bandwidth_bytes_per_s(text: Any) -> float:
    """'40 Gbit/s' -> 5e9; anything else is a ValueError saying what was expected."""
    match = _BANDWIDTH.match(text) if isinstance(text, str) else None
    if not match or match.group(2) not in _BANDWIDTH_UNITS:
        units = ", ".join(_BANDWIDTH_UNITS)
        raise ValueError(f"expected a bandwidth such as \"40 Gbit/s\" or \"230 GB/s\" (units: {units}), got {text!r}")
    value = float(match.group(1)) * _BANDWIDTH_UNITS[match.group(2)]
    if not MIN_BANDWIDTH_BYTES_PER_S <= value <= MAX_BANDWIDTH_BYTES_PER_S:  # also refuses inf ("1e999 GB/s")
        raise ValueError(f"expected a bandwidth from 1 kB/s to 1 PB/s, got {text!r}")
    return value


def parse_bandwidth(text: Any, where: str) -> float:
    """'40 Gbit/s' -> 5e9 (bytes per second); anything else is an InputError at `where`."""
    try:
        return bandwidth_bytes_per_s(text)
    except ValueError as err:
        raise InputError(where, str(err)) from None


Bandwidth = Annotated[float, BeforeValidator(bandwidth_bytes_per_s)]
"""A field of a fasop.tomlfile.Table written as a string with a unit, read as bytes per second."""


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
    intra_node_latency_s: float = DEFAULT_INTRA_NODE_LATENCY_US * 1e-6  # one step of a transfer inside the node
    inter_node_latency_s: float = DEFAULT_INTER_NODE_LATENCY_US * 1e-6  # one step across its network interface
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


# GiB of every GPU that neither model state nor activations may use (docs/formats.md, cluster files): the CUDA
# context with PyTorch's kernels (about 0.5 GiB) and NCCL's buffers, NCCL_BUFFSIZE = 4 MiB per channel and peer
# in each direction for up to 32 channels (256 MiB) for each of the tensor-, data-, pipeline- and
# embedding-parallel communicators a Megatron-LM rank opens.
GPU_MEMORY_OVERHEAD_GIB = 1.5


@dataclass(frozen=True)
class Cluster:
    name: str
    node_types: dict[str, NodeType]
    derating: Derating = Derating()
    memory_margin: float = 1.0
    gpu_memory_overhead_gib: float = GPU_MEMORY_OVERHEAD_GIB
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

    def with_counts(self, counts: dict[str, int]) -> Cluster:
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


class NodeTypeTable(Table):
    """One [[node_type]] table (docs/formats.md)."""

    name: Name
    gpu: Name  # also names the GPU's profile files
    instance: Text = ""
    gpus_per_node: Annotated[int, Range(1, MAX_GPUS_PER_NODE)]
    gpu_memory_gib: Annotated[float, Range(0.0, MAX_GPU_MEMORY_GIB, low_allowed=False)] | None = None
    intra_node_bandwidth: Bandwidth
    inter_node_bandwidth: Bandwidth
    intra_node_latency_us: Annotated[float, Range(0.0, MAX_LATENCY_US)] = DEFAULT_INTRA_NODE_LATENCY_US
    inter_node_latency_us: Annotated[float, Range(0.0, MAX_LATENCY_US)] = DEFAULT_INTER_NODE_LATENCY_US
    price_per_hour_usd: Annotated[float, Range(0.0, MAX_PRICE_PER_HOUR_USD)]
    price_source: Text = ""
    price_date: Text = ""
    count: Annotated[int, Range(0, MAX_NODES_PER_TYPE)]
    slurm_partition: Text | None = None
    gres_type: Text | None = None


Ratio = Annotated[float, Range(0.0, MAX_DERATING, low_allowed=False)]


class DeratingTable(Table):
    p2p_intra_node: Ratio = 1.0
    p2p_inter_node: Ratio = 1.0
    collective_intra_node: Ratio = 1.0
    collective_inter_node: Ratio = 1.0


class ClusterHead(Table):
    name: Name
    description: Text = ""
    memory_margin: Annotated[float, Range(0.0, MAX_MEMORY_MARGIN, low_allowed=False)] = 1.0
    gpu_memory_overhead_gib: Annotated[float, Range(0.0, MAX_GPU_MEMORY_GIB)] = GPU_MEMORY_OVERHEAD_GIB
    derating: DeratingTable = Field(default_factory=DeratingTable)


class ClusterFile(Table):
    cluster: ClusterHead
    node_type: list[NodeTypeTable] = Field(min_length=1)
    launch: dict[str, Any] = Field(default_factory=dict)  # site defaults, checked by fasop.emit where it reads them
    gpu: Any = None  # [[gpu]] tables, read by fasop.catalogue.gpu_tables


def _gpu_memory_gib(table: NodeTypeTable, where: str, catalogue: Callable[[], dict[str, Any]]) -> float:
    """The node type's gpu_memory_gib, or else the memory_gib of its GPU in the catalogue."""
    if table.gpu_memory_gib is not None:
        return table.gpu_memory_gib
    spec = catalogue().get(table.gpu)
    if spec is None:
        raise InputError(f"{where}.gpu_memory_gib", f"missing, and GPU {table.gpu!r} is in neither the bundled "
                                                    "catalogue/gpus.toml nor this file's [[gpu]] tables")
    return spec.memory_gib


def _node_type(table: NodeTypeTable, file: str, catalogue: Callable[[], dict[str, Any]]) -> NodeType:
    return NodeType(
        name=table.name,
        gpu=table.gpu,
        gpus_per_node=table.gpus_per_node,
        gpu_memory_gib=_gpu_memory_gib(table, f"{file}: node_type.{table.name}", catalogue),
        intra_node_bytes_per_s=table.intra_node_bandwidth,
        inter_node_bytes_per_s=table.inter_node_bandwidth,
        price_per_hour_usd=table.price_per_hour_usd,
        count=table.count,
        intra_node_latency_s=table.intra_node_latency_us * 1e-6,
        inter_node_latency_s=table.inter_node_latency_us * 1e-6,
        instance=table.instance,
        price_source=table.price_source,
        price_date=table.price_date,
        slurm_partition=table.slurm_partition,
        gres_type=table.gres_type,
    )


def load_cluster(name_or_path: str) -> Cluster:
    """Load a cluster from a TOML file, or a bundled cluster by name (`fasop-1xA100-7xA10`, ...)."""
    path, is_bundled = bundled.locate("clusters", name_or_path, ".toml", "--cluster")
    file = str(path)
    cluster = validated(ClusterFile, read_toml(path), file)
    from fasop.inputs.catalogue import gpu_tables, merged_specs  # they read bandwidths with this module, so not on top

    gpus = gpu_tables(cluster.gpu, file) if cluster.gpu is not None else {}
    # the bundled catalogue with the file's own GPUs over it, read only if a node type leaves out its memory
    catalogue = functools.cache(lambda: merged_specs(own=gpus))
    types: dict[str, NodeType] = {}
    for table in cluster.node_type:
        if table.name in types:
            raise InputError(f"{file}: node_type.{table.name}", "defined twice")
        types[table.name] = _node_type(table, file, catalogue)
    sizes = {t.gpus_per_node for t in types.values()}
    if len(sizes) > 1:
        raise InputError(f"{file}: node_type.gpus_per_node",
                         "all node types need the same GPUs per node (Megatron-LM gives every node the same number "
                         f"of ranks), got {sorted(sizes)}")
    if all(t.count == 0 for t in types.values()):
        raise InputError(f"{file}: node_type.count", "expected at least one available node")
    head = cluster.cluster
    return Cluster(
        name=head.name,
        node_types={n: t for n, t in types.items() if t.count > 0},
        derating=Derating(**dict(head.derating)),
        memory_margin=head.memory_margin,
        gpu_memory_overhead_gib=head.gpu_memory_overhead_gib,
        description=head.description,
        launch=cluster.launch,
        file=name_or_path if is_bundled else file,
        gpus=gpus,
    )
