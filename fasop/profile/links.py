"""Link figures from measured transfer times: the launch's rank layout, the alpha-beta fit and the cluster-file
fragment that `fasop profile links` writes. No torch here; the timing itself is in fasop.profile.linkbench.

Each measurement is fitted as t = alpha + x / beta, where x is the bytes the cost model charges to one link
for that operation (docs/cost-model.md), so that beta is directly the figure a cluster file holds:

  p2p_intra_node        every GPU of a node paired with a neighbour, all pairs at once: x = message bytes;
                        beta is a per-GPU bandwidth, as `intra_node_bandwidth`.
  p2p_inter_node        local rank i of node 0 paired with local rank i of node 1, all pairs at once, so the
                        pairs share each node's network interface: x = pairs x message bytes; beta is a
                        per-node bandwidth, as `inter_node_bandwidth`.
  allreduce_intra_node  each node all-reduces over its own g GPUs (ring): x = 2 (g-1)/g x message bytes.
  allreduce_inter_node  one all-reduce per local rank across the k nodes, all at once (the data-parallel
                        groups of a plan whose tensor ranks share a node): x = 2 (k-1)/k x g x message bytes.

The fit weighs every point by 1/t (relative residuals), so the small messages that set alpha count as much as
the large ones that set beta, and it is non-negative least squares (scipy.optimize.nnls): neither a latency
nor a time per byte can come out negative.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fasop.errors import ArgumentError, InputError
from fasop.files import comment_line

KINDS = ("p2p_intra_node", "p2p_inter_node", "allreduce_intra_node", "allreduce_inter_node")
DEFAULT_SIZES = "8K,64K,512K,4M,32M,256M"
_SIZE = re.compile(r"^([0-9]+)([KMG]?)$")
_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
FLOAT32_BYTES = 4


def parse_message_sizes(sizes_text: str) -> tuple[int, ...]:
    """'8K,1M' -> (8192, 1048576): bytes, with binary K, M, G suffixes; sorted, distinct, multiples of 4."""
    sizes = []
    for part in sizes_text.split(","):
        match = _SIZE.match(part.strip())
        size = int(match.group(1)) * _SIZE_UNITS[match.group(2)] if match else 0
        if size < FLOAT32_BYTES or size % FLOAT32_BYTES:
            raise ArgumentError("sizes_text", "expected comma-separated message sizes in bytes, multiples of 4, with "
                                              f"optional K, M or G (binary) suffixes, such as 8K,1M; got {part!r}", sizes_text)
        sizes.append(size)
    if len(set(sizes)) < 2:
        raise ArgumentError("sizes_text", "expected at least two different message sizes (two points fix a line)", sizes_text)
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class Launch:
    """This process's place in the job, from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    node_id: str  # node rank given by the launcher (torchrun GROUP_RANK, Slurm SLURM_NODEID), or ""


def _env_int(env: Mapping[str, str], names: tuple[str, ...], minimum: int) -> int | None:
    for name in names:
        if name in env:
            value = env[name]
            if not value.isdigit() or int(value) < minimum:
                raise InputError(f"environment variable {name}", f"expected an integer >= {minimum}, got {value!r}")
            return int(value)
    return None


def launch_from_env(env: Mapping[str, str]) -> Launch:
    """RANK/WORLD_SIZE/LOCAL_RANK (torchrun) or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (srun)."""
    rank = _env_int(env, ("RANK", "SLURM_PROCID"), 0)
    world = _env_int(env, ("WORLD_SIZE", "SLURM_NTASKS"), 1)
    local = _env_int(env, ("LOCAL_RANK", "SLURM_LOCALID"), 0)
    if rank is None or world is None:
        raise InputError("fasop profile links", "expected to be started by torchrun or srun, one process per GPU "
                                                "(RANK and WORLD_SIZE, or SLURM_PROCID and SLURM_NTASKS, are not set)")
    if world < 2:
        raise InputError("fasop profile links", f"needs at least 2 processes to time a link, got WORLD_SIZE {world}")
    if rank >= world:
        raise InputError("environment variable RANK", f"expected a rank below WORLD_SIZE {world}, got {rank}")
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise InputError("fasop profile links", "MASTER_ADDR and MASTER_PORT are not set (torchrun sets them; "
                                                "under srun, export them in the batch script)")
    node = env.get("GROUP_RANK", env.get("SLURM_NODEID", ""))
    return Launch(rank, world, local if local is not None else 0, node)


def group_nodes(keys: list[str]) -> list[list[int]]:
    """Ranks of each node, nodes in order of their lowest rank; `keys[r]` names rank r's node."""
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return list(nodes.values())


def link_bytes(kind: str, message_bytes: int, nodes: list[list[int]]) -> float:
    """The bytes one link carries for one message of `kind` (see the module docstring)."""
    g = min(len(n) for n in nodes)
    k = len(nodes)
    if kind == "p2p_intra_node":
        return float(message_bytes)
    if kind == "p2p_inter_node":
        return float(g * message_bytes)
    if kind == "allreduce_intra_node":
        return 2 * (g - 1) / g * message_bytes
    return 2 * (k - 1) / k * g * message_bytes


def measurable(nodes: list[list[int]]) -> tuple[str, ...]:
    """Kinds this layout can time: intra-node ones need two GPUs per node, inter-node ones two nodes."""
    kinds = []
    if min(len(n) for n in nodes) >= 2:
        kinds += ["p2p_intra_node", "allreduce_intra_node"]
    if len(nodes) >= 2:
        kinds += ["p2p_inter_node", "allreduce_inter_node"]
    return tuple(k for k in KINDS if k in kinds)


@dataclass(frozen=True)
class Fit:
    latency_s: float  # alpha
    bytes_per_s: float  # beta
    rms_relative_error: float


def fit_alpha_beta(link_bytes_: np.ndarray, times_s: np.ndarray, where: str = "fit") -> Fit:
    """Least-squares t = alpha + x / beta with relative weights and alpha, 1/beta >= 0."""
    x, t = np.asarray(link_bytes_, dtype=float), np.asarray(times_s, dtype=float)
    if len(x) < 2 or len(np.unique(x)) < 2 or not (np.isfinite(t).all() and (t > 0).all()):
        raise InputError(where, "expected positive times at two or more message sizes")
    from scipy.optimize import nnls  # here, not at the top: scipy.optimize takes a third of a second to load

    weight = 1.0 / t
    (alpha, per_byte), _ = nnls(np.column_stack([np.ones_like(x), x]) * weight[:, None], t * weight)
    if per_byte <= 0:
        raise InputError(where, "times do not grow with message size; measure larger messages")
    residual = (alpha + x * per_byte - t) / t
    return Fit(float(alpha), float(1.0 / per_byte), float(math.sqrt(np.mean(residual**2))))


# -- the cluster-file fragment ------------------------------------------------------------------------------------
def format_bandwidth(bytes_per_s: float) -> str:
    """A bandwidth string that fasop.inputs.bandwidth.parse_bandwidth reads back within 0.05%."""
    return f"{bytes_per_s / 1e9:.4f} GB/s" if bytes_per_s >= 1e8 else f"{bytes_per_s / 1e6:.4f} MB/s"


def format_fragment(fits: dict[str, Fit], header: list[str]) -> str:
    """The TOML text: the node type's bandwidth fields, and the derating and latencies as comments."""
    out = [comment_line(line) for line in header]  # hosts and paths: a newline there would start a TOML line
    out += ["#", "# Latency (alpha) of each operation; fasop's cluster format has no latency field, so these are",
            "# for reference only:"]
    out += [f"#   {kind}_latency_s = {fits[kind].latency_s:.4g}" for kind in KINDS if kind in fits]
    out += ["#", "# Fit quality (root mean square of the relative residuals):"]
    out += [f"#   {kind}: {fits[kind].rms_relative_error:.3g}" for kind in KINDS if kind in fits]
    deratings = []
    for link in ("intra_node", "inter_node"):
        if f"allreduce_{link}" in fits:
            deratings.append(f"#   p2p_{link} = {fits[f'allreduce_{link}'].bytes_per_s / fits[f'p2p_{link}'].bytes_per_s:.4g}")
    if deratings:
        out += ["#", "# The bandwidth fields are all-reduce figures. To charge pipeline sends at the measured",
                "# point-to-point speed, set these in the cluster's [cluster.derating] table (cluster-wide: with",
                "# several node types, measure each and pick one value):"]
        out += deratings + ["#   collective_intra_node = 1.0", "#   collective_inter_node = 1.0"]
    out += ["#", "# Paste the lines below into the node type's [[node_type]] table."]
    for link, field in (("intra_node", "intra_node_bandwidth"), ("inter_node", "inter_node_bandwidth")):
        kind = f"allreduce_{link}"
        if kind in fits:
            out.append(f'{field} = "{format_bandwidth(fits[kind].bytes_per_s)}"')
        else:
            out.append(f"# {field}: not measured ({'one GPU per node' if link == 'intra_node' else 'one node'})")
    return "\n".join(out) + "\n"
