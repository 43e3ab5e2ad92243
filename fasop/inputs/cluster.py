"""The cluster description: node types, their GPUs, links, prices and how many are available."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import Field, WrapValidator

from fasop.errors import InputError
from fasop.inputs import bundled
from fasop.inputs.bandwidth import Bandwidth
from fasop.inputs.catalogue import GpuSpec, gpu_tables, merged_specs
from fasop.inputs.errorband import BandTable, ErrorBand, table_band
from fasop.inputs.names import NAME, NAME_RULE, Name
from fasop.inputs.tomlfile import Range, Table, Text, expected, read_toml, validated

# Latency of one step of a transfer, microseconds: NCCL's own tuning model (src/graph/tuning.cc, hwLat, ring
# algorithm with the Simple protocol, which large transfers use) charges 3.4 us per NVLink hop and 9.6 us per
# network hop.
DEFAULT_INTRA_NODE_LATENCY_US = 3.4
DEFAULT_INTER_NODE_LATENCY_US = 9.6
MAX_LATENCY_US = 1e6


FABRICS = ("infiniband", "efa", "ethernet")
# NCCL's interface and device lists: names, "," between them, "^" (exclude) and "=" (exact name) before them
NCCL_LIST = r"\^?=?[A-Za-z0-9_.:-]+(,=?[A-Za-z0-9_.:-]+)*"


class NetworkTable(Table):
    """A node type's `network` table (docs/formats.md): its fabric, and the NCCL names that differ from the
    fabric's defaults (clusters/catalogue/fabrics.toml)."""

    fabric: Literal["infiniband", "efa", "ethernet"]
    socket_ifname: Annotated[str, Field(pattern=f"^{NCCL_LIST}$"), expected("an NCCL interface list such as eth0 "
                                                                           "or ^lo,docker")] | None = None
    ib_hca: Annotated[str, Field(pattern=f"^{NCCL_LIST}$"), expected("an NCCL device list such as mlx5 or "
                                                                    "mlx5_0:1,mlx5_1:1")] | None = None



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
    gpu_memory_bytes_per_s: float  # per GPU, its memory bandwidth: the pace of the optimizer step
    intra_node_latency_s: float = DEFAULT_INTRA_NODE_LATENCY_US * 1e-6  # one step of a transfer inside the node
    inter_node_latency_s: float = DEFAULT_INTER_NODE_LATENCY_US * 1e-6  # one step across its network interface
    instance: str = ""
    price_source: str = ""
    price_date: str = ""
    slurm_partition: str | None = None
    gres_type: str | None = None
    cpus_per_node: int | None = None  # the one task per node gets them all (--cpus-per-task)
    network: NetworkTable | None = None
    # A node holding several GPU kinds is a node type of each kind, a block of its GPUs: the node type it is
    # a block of (Cluster.hosts) and the CUDA index of its first GPU there; "" for a node of one kind
    host: str = ""
    host_first_gpu: int = 0
    # nodes of this type that share one NVLink domain (a GB200 NVL72 rack: 18 trays of 4 GPUs); 1: the node's own
    nvlink_domain_nodes: int = 1


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
    gpus: dict[str, GpuSpec] = field(default_factory=dict)  # the file's own [[gpu]] specs (fasop.inputs.catalogue)
    error_band: ErrorBand | None = None  # the user's runs' band (a calibrated file); None: the published runs'
    # node types holding several GPU kinds, whole (gpu: the kinds joined by "+", intra-node link: between kinds,
    # price: the node's); node_types holds a block node type of each kind in their place
    hosts: dict[str, NodeType] = field(default_factory=dict)

    @property
    def node_sizes(self) -> tuple[int, ...]:
        """The GPU counts per node its node types have, smallest first (of each block of a node holding
        several GPU kinds)."""
        return tuple(sorted({t.gpus_per_node for t in self.node_types.values()}))

    @property
    def one_kind_per_node(self) -> bool:
        """Whether every node holds one GPU kind and all hold as many: what plans of one tensor and data
        degree (stock Megatron-LM, DDP, ZeRO) need, every node running as many ranks of one kind."""
        return len(self.node_sizes) == 1 and not self.hosts

    @property
    def gpus_per_node(self) -> int:
        """The one GPU count per node of its node types, which stock Megatron-LM, DDP and ZeRO plans need (every
        node runs as many ranks); a cluster whose nodes differ is refused here, never answered for one."""
        if not self.one_kind_per_node:
            whole = [*self.hosts.values(), *(t for t in self.node_types.values() if not t.host)]
            held = ", ".join(f"{t.name} {t.gpus_per_node} {t.gpu}" for t in whole)
            raise InputError(f"{self.file or self.name}: node_type.gpus_per_node",
                             "expected one GPU kind and count per node for plans of one tensor and data degree, got "
                             f"{held}; only stage-group plans (each stage its own node type) use such nodes")
        return self.node_sizes[0]

    @property
    def num_nodes(self) -> int:
        return sum(t.count for t in self.node_types.values())

    @property
    def num_gpus(self) -> int:
        return sum(t.count * t.gpus_per_node for t in self.node_types.values())

    @property
    def price_per_hour_usd(self) -> float:
        return sum(t.count * t.price_per_hour_usd for t in self.node_types.values())

    def with_counts(self, counts: dict[str, int]) -> Cluster:
        """The same cluster with other node counts (node types at 0 are dropped)."""
        types = {n: replace(t, count=counts[n]) for n, t in self.node_types.items() if counts.get(n, 0) > 0}
        hosts = {n: t for n, t in self.hosts.items() if any(block.host == n for block in types.values())}
        return replace(self, node_types=types, hosts=hosts)

    def with_memory_time_scales(self, scales: dict[str, float]) -> Cluster:
        """The same cluster with the memory bandwidth of each GPU type in `scales` divided by its scale: the
        optimizer step, a memory-bound pass, takes that many times as long, as the GPU's scaled profile times do
        (noise trials, calibration)."""
        types = {n: replace(t, gpu_memory_bytes_per_s=t.gpu_memory_bytes_per_s / scales.get(t.gpu, 1.0))
                 for n, t in self.node_types.items()}
        return replace(self, node_types=types)


# Ranges of the numbers of a cluster file (docs/formats.md): generous, but finite products of them stay finite.
MAX_GPUS_PER_NODE = 1024
MAX_GPU_MEMORY_GIB = 65536.0
MAX_PRICE_PER_HOUR_USD = 1e6
MAX_NODES_PER_TYPE = 1_000_000
MAX_CPUS_PER_NODE = 1_000_000  # the one task per node gets them all (--cpus-per-task)
MAX_DERATING = 1000.0
# memory_margin multiplies the estimated memory to cover what the allocator wastes beside it: 1 is no margin, and
# one below 1 would count memory the GPU does not have (1e-10 takes every GPU for 1e10 times its size)
MIN_MEMORY_MARGIN, MAX_MEMORY_MARGIN = 1.0, 100.0


GpuCount = Annotated[int, Range(1, MAX_GPUS_PER_NODE)]
MAX_NVLINK_DOMAIN_GPUS = 2**16  # an NVLink switch domain: 72 GPUs in a GB200 NVL72 rack, 576 in NVIDIA's largest
MemoryGib = Annotated[float, Range(0.0, MAX_GPU_MEMORY_GIB, low_allowed=False)]
LatencyUs = Annotated[float, Range(0.0, MAX_LATENCY_US)]


class GpuKindTable(Table):
    """One GPU kind of a node holding several (`gpus = [...]` of a [[node_type]] table, docs/formats.md)."""

    gpu: Name
    count: GpuCount
    gpu_memory_gib: MemoryGib | None = None
    gpu_memory_bandwidth: Bandwidth | None = None
    intra_node_bandwidth: Bandwidth | None = None  # between GPUs of this kind; default: the node's
    intra_node_latency_us: LatencyUs | None = None


def _kinds_or_refuse(value: Any, handler: Callable[[Any], Any]) -> Any:
    """`gpus`: two or more tables, each then checked field by field."""
    if not isinstance(value, list) or len(value) < 2 or not all(isinstance(item, dict) for item in value):
        raise ValueError(f"expected an array of two or more tables {{ gpu = NAME, count = N }}, got {value!r}")
    return handler(value)


GpuKinds = Annotated[list[GpuKindTable], WrapValidator(_kinds_or_refuse)]


class NodeTypeTable(Table):
    """One [[node_type]] table (docs/formats.md)."""

    name: Name
    gpu: Name | None = None  # also names the GPU's profile files; or `gpus`, the kinds of a node holding several
    gpus: GpuKinds | None = None
    instance: Text = ""
    gpus_per_node: GpuCount | None = None
    gpu_memory_gib: MemoryGib | None = None
    gpu_memory_bandwidth: Bandwidth | None = None
    intra_node_bandwidth: Bandwidth
    inter_node_bandwidth: Bandwidth
    intra_node_latency_us: LatencyUs = DEFAULT_INTRA_NODE_LATENCY_US
    inter_node_latency_us: LatencyUs = DEFAULT_INTER_NODE_LATENCY_US
    price_per_hour_usd: Annotated[float, Range(0.0, MAX_PRICE_PER_HOUR_USD)]
    price_source: Text = ""
    price_date: Text = ""
    count: Annotated[int, Range(0, MAX_NODES_PER_TYPE)]
    slurm_partition: Text | None = None
    gres_type: Text | None = None
    cpus_per_node: Annotated[int, Range(1, MAX_CPUS_PER_NODE)] | None = None
    network: NetworkTable | None = None
    nvlink_domain_gpus: Annotated[int, Range(1, MAX_NVLINK_DOMAIN_GPUS)] | None = None  # default: the GPU's table


Ratio = Annotated[float, Range(0.0, MAX_DERATING, low_allowed=False)]


class DeratingTable(Table):
    p2p_intra_node: Ratio = 1.0
    p2p_inter_node: Ratio = 1.0
    collective_intra_node: Ratio = 1.0
    collective_inter_node: Ratio = 1.0


class ClusterHead(Table):
    name: Name
    description: Text = ""
    memory_margin: Annotated[float, Range(MIN_MEMORY_MARGIN, MAX_MEMORY_MARGIN)] = 1.0
    gpu_memory_overhead_gib: Annotated[float, Range(0.0, MAX_GPU_MEMORY_GIB)] = GPU_MEMORY_OVERHEAD_GIB
    derating: DeratingTable = Field(default_factory=DeratingTable)
    error_band: BandTable | None = None  # written by fasop calibrate


class ClusterFile(Table):
    cluster: ClusterHead
    node_type: list[NodeTypeTable] = Field(min_length=1)
    launch: dict[str, Any] = Field(default_factory=dict)  # site defaults, checked by fasop.emit where it reads them
    gpu: Any = None  # [[gpu]] tables, read by fasop.inputs.catalogue.gpu_tables


def _gpu_figure(table: NodeTypeTable | GpuKindTable, gpu: str, field: str, figure: str, where: str,
                catalogue: Callable[[], dict[str, GpuSpec]]) -> float:
    """The table's `field`, or else the `figure` of its GPU's spec in the catalogue; neither is refused, naming
    the GPU."""
    given = getattr(table, field)
    if given is not None:
        return given
    spec = catalogue().get(gpu)
    if spec is None:
        raise InputError(f"{where}.{field}", f"missing, and GPU {gpu!r} is in neither the bundled "
                                             "clusters/catalogue/gpus.toml nor this file's [[gpu]] tables")
    return getattr(spec, figure)


def _node_types(table: NodeTypeTable, file: str, catalogue: Callable[[], dict[str, GpuSpec]]) -> list[NodeType]:
    """The node type of `table`; for a node holding several GPU kinds, the whole node (first) and a block node
    type of each kind, in the order of its CUDA device indices."""
    where = f"{file}: node_type.{table.name}"
    if table.gpus is None:
        for name in ("gpu", "gpus_per_node"):
            if getattr(table, name) is None:
                raise InputError(f"{where}.{name}", "missing: expected `gpu` and `gpus_per_node`, or `gpus`, the GPU "
                                                    "kinds of a node holding several")
        assert table.gpu is not None and table.gpus_per_node is not None
        node_type = _node_type(table, file, catalogue, table.gpu, table.gpus_per_node)
        return [replace(node_type, nvlink_domain_nodes=_domain_nodes(table, table.gpu, table.gpus_per_node, where,
                                                                     catalogue))]
    for name in ("gpu", "gpus_per_node", "gpu_memory_gib", "gpu_memory_bandwidth", "nvlink_domain_gpus"):
        if getattr(table, name) is not None:
            raise InputError(f"{where}.{name}", "given beside `gpus`: each GPU kind of the node names its own")
    kinds = [kind.gpu for kind in table.gpus]
    if len(set(kinds)) < len(kinds):
        raise InputError(f"{where}.gpus", f"expected each GPU kind once, got {', '.join(kinds)}")
    total = sum(kind.count for kind in table.gpus)
    if total > MAX_GPUS_PER_NODE:
        raise InputError(f"{where}.gpus", f"{total} GPUs in all: expected at most {MAX_GPUS_PER_NODE}")
    whole = _node_type(table, file, catalogue, "+".join(kinds), total, gpu_figures=False)
    blocks, first = [], 0
    for i, kind in enumerate(table.gpus):
        name = f"{table.name}.{kind.gpu}"
        if not NAME.fullmatch(name):
            raise InputError(f"{where}.gpus", f"the node type of its {kind.gpu} GPUs, {name!r}, is not {NAME_RULE}")
        block = _node_type(table, file, catalogue, kind.gpu, kind.count, kind, f"{where}.gpus.{i}")
        blocks.append(replace(
            block, name=name, price_per_hour_usd=table.price_per_hour_usd * kind.count / total, host=table.name,
            host_first_gpu=first, intra_node_bytes_per_s=table.intra_node_bandwidth if kind.intra_node_bandwidth is None
            else kind.intra_node_bandwidth,
            intra_node_latency_s=(table.intra_node_latency_us if kind.intra_node_latency_us is None
                                  else kind.intra_node_latency_us) * 1e-6))
        first += kind.count
    return [whole, *blocks]


def _domain_nodes(table: NodeTypeTable, gpu: str, gpus: int, where: str,
                  catalogue: Callable[[], dict[str, GpuSpec]]) -> int:
    """Nodes per NVLink domain: the table's nvlink_domain_gpus, else its GPU's in the catalogue, else one node;
    whole nodes only."""
    domain = table.nvlink_domain_gpus
    if domain is None:
        spec = catalogue().get(gpu)
        domain = spec.nvlink_domain_gpus if spec is not None and spec.nvlink_domain_gpus else gpus
    if domain % gpus:
        raise InputError(f"{where}.nvlink_domain_gpus", f"expected a multiple of the node's {gpus} GPUs, got {domain}"
                                                        + ("" if table.nvlink_domain_gpus else f" (GPU {gpu}'s table)"))
    return max(domain // gpus, 1)


def _node_type(table: NodeTypeTable, file: str, catalogue: Callable[[], dict[str, GpuSpec]], gpu: str, gpus: int,
               figures: NodeTypeTable | GpuKindTable | None = None, where: str | None = None,
               gpu_figures: bool = True) -> NodeType:
    """A node type of `gpus` GPUs of kind `gpu`, its GPU's figures from `figures` (default: `table`) or the
    catalogue (none for a node of several kinds: gpu_figures False)."""
    where = where or f"{file}: node_type.{table.name}"
    figures = figures or table
    return NodeType(
        name=table.name,
        gpu=gpu,
        gpus_per_node=gpus,
        gpu_memory_gib=_gpu_figure(figures, gpu, "gpu_memory_gib", "memory_gib", where, catalogue)
        if gpu_figures else 0.0,
        intra_node_bytes_per_s=table.intra_node_bandwidth,
        inter_node_bytes_per_s=table.inter_node_bandwidth,
        price_per_hour_usd=table.price_per_hour_usd,
        count=table.count,
        gpu_memory_bytes_per_s=_gpu_figure(figures, gpu, "gpu_memory_bandwidth", "memory_bytes_per_s", where, catalogue)
        if gpu_figures else 0.0,
        intra_node_latency_s=table.intra_node_latency_us * 1e-6,
        inter_node_latency_s=table.inter_node_latency_us * 1e-6,
        instance=table.instance,
        price_source=table.price_source,
        price_date=table.price_date,
        slurm_partition=table.slurm_partition,
        gres_type=table.gres_type,
        cpus_per_node=table.cpus_per_node,
        network=table.network,
    )


def load_cluster(cluster_name: str) -> Cluster:
    """Load a cluster from a TOML file, or a bundled cluster by name (`fasop-1xA100-7xA10`, ...)."""
    path, is_bundled = bundled.locate("clusters", cluster_name, ".toml", "cluster_name")
    file = str(path)
    cluster = validated(ClusterFile, read_toml(path), file)
    gpus = gpu_tables(cluster.gpu, file) if cluster.gpu is not None else {}
    # the bundled catalogue with the file's own GPUs over it (the one place a cluster's GPUs are looked up), read
    # once, for what a node type leaves out: its GPU's memory, memory bandwidth or NVLink domain
    catalogue = functools.cache(lambda: merged_specs(own=gpus))
    types: dict[str, NodeType] = {}
    hosts: dict[str, NodeType] = {}
    for table in cluster.node_type:
        first, *blocks = _node_types(table, file, catalogue)
        for node_type in [first, *blocks]:
            if node_type.name in types or node_type.name in hosts:
                raise InputError(f"{file}: node_type.{node_type.name}", "defined twice")
        if blocks:
            hosts[first.name] = first
        types.update((t.name, t) for t in blocks or [first])
    if all(t.count == 0 for t in types.values()):
        raise InputError(f"{file}: node_type.count", "expected at least one available node")
    head = cluster.cluster
    return Cluster(
        name=head.name,
        node_types={n: t for n, t in types.items() if t.count > 0},
        hosts={n: t for n, t in hosts.items() if t.count > 0},
        derating=Derating(**dict(head.derating)),
        memory_margin=head.memory_margin,
        error_band=None if head.error_band is None else table_band(head.error_band, f"{file}: cluster.error_band."),
        gpu_memory_overhead_gib=head.gpu_memory_overhead_gib,
        description=head.description,
        launch=cluster.launch,
        file=cluster_name if is_bundled else file,
        gpus=gpus,
    )
