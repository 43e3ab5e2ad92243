"""Hypothesis strategies for the property suite: random valid models, clusters and synthesised profiles.

Every generated input is valid by the documented formats (docs/formats.md): realistic shapes, memories,
bandwidths and prices, so that a refusal by fasop is itself a failure. Inputs are written to files and read
back through the loaders, as a user's would be.
"""

from __future__ import annotations

import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import toml_table
from hypothesis import strategies as st

from fasop.inputs import bundled
from fasop.inputs.catalogue import load_gpu_specs
from fasop.inputs.cluster import Cluster, load_cluster
from fasop.inputs.model import Model, load_model
from fasop.profile.synth import format_profile, header_lines, synthesize

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

GPU_SPECS = load_gpu_specs()
PROFILED_DEGREES = (1, 2, 4, 8)
PROFILED_MBS = (1, 2, 4, 8)
# bytes per second of one unit of each accepted spelling (docs/formats.md)
BANDWIDTH_UNITS = {
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
    "B/s": 1.0, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "GiB/s": 2.0**30,
}

# names of models, clusters and node types: the characters that launch scripts can carry unquoted
names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,7}", fullmatch=True)
# node types are often named like "a100-80gb" or "g5.12xlarge": two parts and a separator
node_type_names = st.one_of(names, st.tuples(names, st.sampled_from("-._+"), names).map("".join))


def log_uniform(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(math.log(low), math.log(high)).map(math.exp)


@st.composite
def bandwidths(draw, low_bytes_per_s: float, high_bytes_per_s: float) -> str:
    """A bandwidth between the two limits, written in a random unit ("3.2 Tbit/s", "450 GB/s", ...)."""
    unit = draw(st.sampled_from(sorted(BANDWIDTH_UNITS)))
    # 0.1% inside the limits: the value is written with 4 significant digits, which may round it up or down
    value = draw(log_uniform(low_bytes_per_s * 1.001, high_bytes_per_s * 0.999)) / BANDWIDTH_UNITS[unit]
    text = draw(st.sampled_from([f"{value:.4g}", f"{value:.6e}"] + ([f"{value:.3f}"] if value >= 1 else [])))
    return f"{text}{draw(st.sampled_from(['', ' ']))}{unit}"


@st.composite
def model_fields(draw) -> dict:
    """The [model] table of a small-to-medium Transformer of any architecture."""
    arch = draw(st.sampled_from(["decoder", "encoder", "encoder-decoder"]))
    fields: dict = {"name": draw(names), "architecture": arch}
    if arch == "encoder-decoder":
        fields["encoder_num_layers"] = draw(st.integers(1, 12))
        fields["decoder_num_layers"] = draw(st.integers(1, 12))
        fields["encoder_seq_length"] = draw(st.sampled_from([64, 128, 256, 512, 1024]))
        fields["decoder_seq_length"] = draw(st.sampled_from([32, 64, 128, 256, 512]))
    else:
        fields["num_layers"] = draw(st.integers(1, 24))
        fields["seq_length"] = draw(st.sampled_from([64, 128, 256, 512, 1024, 2048, 4096]))
    heads = draw(st.sampled_from([1, 2, 4, 8, 12, 16, 32]))
    kv_channels = draw(st.sampled_from([32, 64, 128]))
    fields["hidden_size"] = heads * kv_channels
    fields["num_attention_heads"] = heads
    fields["num_query_groups"] = draw(st.sampled_from([g for g in (1, 2, 4, 8, 16, 32) if heads % g == 0]))
    fields["ffn_hidden_size"] = heads * kv_channels * draw(st.sampled_from([2, 3, 4]))
    fields["vocab_size"] = draw(st.integers(1000, 64000))
    fields["tie_embeddings"] = draw(st.booleans())
    fields["position_embedding"] = draw(st.sampled_from(["learned", "rope", "relative"]))
    fields["normalization"] = draw(st.sampled_from(["layernorm", "rmsnorm"]))
    fields["ffn_activation"] = draw(st.sampled_from(["gelu", "swiglu"]))
    fields["flash_attention"] = draw(st.booleans())
    fields["dropout"] = draw(st.booleans())
    fields["linear_bias"] = draw(st.booleans())
    fields["precision"] = draw(st.sampled_from(["fp16", "bf16"]))
    return fields


HARDWARE = ("gpu", "gpu_memory_gib", "gpu_memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth")


@st.composite
def cluster_tables(draw, precision: str, gpus: list[str] | None = None, most_nodes: int = 16) -> tuple[dict, list[dict]]:
    """([cluster] table, [[node_type]] tables): 1 to 3 node types of 1 to `most_nodes` nodes, one GPUs-per-node
    size, GPUs from `gpus` (default: every catalogue GPU with a peak for `precision`)."""
    if gpus is None:
        gpus = sorted(g for g, spec in GPU_SPECS.items()
                      if (spec.dense_bf16_tflops if precision == "bf16" else spec.dense_fp16_tflops) > 0)
    gpus_per_node = draw(st.sampled_from([1, 2, 4, 8]))
    type_names = draw(st.lists(node_type_names, min_size=1, max_size=3, unique=True))
    nodes: list[dict] = []
    for name in type_names:
        node = {
            "name": name,
            "gpu": draw(st.sampled_from(gpus)),
            "gpus_per_node": gpus_per_node,
            "gpu_memory_gib": round(draw(log_uniform(2.0, 160.0)), 2),
            "intra_node_bandwidth": draw(bandwidths(1e9, 1e15)),  # up to 1 PB/s: generous links
            "inter_node_bandwidth": draw(bandwidths(1e7, 1e15)),
        }
        if node["gpu"] not in GPU_SPECS or draw(st.booleans()):  # the catalogue's figure, or the node type's own
            node["gpu_memory_bandwidth"] = draw(bandwidths(1e11, 1e13))
        if nodes and draw(st.booleans()):  # the same hardware under another name (a second partition, say)
            node = {key: value for key, value in node.items() if key not in HARDWARE}
            node.update({key: value for key, value in nodes[0].items() if key in HARDWARE})
        node["price_per_hour_usd"] = draw(st.one_of(st.just(0.0), st.floats(0.05, 100.0).map(lambda p: round(p, 4))))
        node["count"] = draw(st.integers(1, most_nodes))
        nodes.append(node)
    head = {"name": draw(names), "memory_margin": draw(st.sampled_from([1.0, 1.05, 1.1, 1.25, 1.5]))}
    if draw(st.booleans()):
        head["derating"] = {k: draw(st.sampled_from([1.0, 1.05, 1.5, 3.5])) for k in (
            "p2p_intra_node", "p2p_inter_node", "collective_intra_node", "collective_inter_node")}
    return head, nodes


@dataclass(frozen=True)
class Spec:
    """One generated problem, as the tables and parameters that files are written from."""

    model: dict
    cluster: dict
    node_types: list[dict]
    efficiency: dict[str, float]  # matmul efficiency of each GPU's synthetic profile
    measured: bool = False  # the model is a bundled one and uses its bundled (measured) profiles

    @property
    def gbs(self) -> int:
        return self.model["global_batch_size"]


def num_layers(model: dict) -> int:
    return model.get("num_layers", 0) + model.get("encoder_num_layers", 0) + model.get("decoder_num_layers", 0)


def bundled_profiles() -> dict[str, list[str]]:
    """GPU types of each bundled model with profiles (measured ones, converted from FASOP's), but for
    llama2-70b: it fits none of these small clusters and searches it slowly."""
    folder = bundled.data_dir("profiles")
    return {model.name: sorted(p.stem for p in model.glob("*.csv")) for model in sorted(folder.iterdir())
            if model.is_dir() and (bundled.data_dir("models") / f"{model.name}.toml").exists()
            and model.name != "llama2-70b"}


MEASURED = bundled_profiles()
MEASURED_MOST_NODES = 4  # per node type: the bundled models have up to 48 layers, and searches grow with both


@st.composite
def specs(draw) -> Spec:
    """A model and a cluster with a global batch size that admits at least one (dp, pp) on all GPUs: a random
    model with synthetic profiles, or (one time in eight) a bundled model with its measured profiles."""
    measured = draw(st.integers(0, 7)) == 7  # not 0: shrinking goes towards the quick synthetic models
    if measured:
        name = draw(st.sampled_from(sorted(MEASURED)))
        with open(bundled.data_dir("models") / f"{name}.toml", "rb") as handle:
            model = tomllib.load(handle)["model"]
        head, nodes = draw(cluster_tables(model.get("precision", "bf16"), MEASURED[name], MEASURED_MOST_NODES))
    else:
        model = draw(model_fields())
        head, nodes = draw(cluster_tables(model["precision"]))
    world = nodes[0]["gpus_per_node"] * sum(n["count"] for n in nodes)
    # fasop's own limit on stages (fasop.search.max_stages): a decoder or encoder stage may hold only the
    # embedding or only the head
    most_stages = num_layers(model) + (0 if model["architecture"] == "encoder-decoder" else 2)
    pp = draw(st.sampled_from([d for d in range(1, min(world, most_stages) + 1) if world % d == 0]))
    model = {**model, "global_batch_size": world // pp * draw(st.sampled_from([1, 2, 3, 4, 8]))}
    efficiency = {gpu: draw(st.sampled_from([0.05, 0.1, 0.3, 0.5, 0.87, 1.0])) for gpu in sorted({n["gpu"] for n in nodes})}
    return Spec(model, head, nodes, {} if measured else efficiency, measured)


@dataclass(frozen=True)
class Written:
    """A Spec written to files under `root` and loaded back."""

    root: Path
    model_path: Path
    cluster_path: Path
    profiles: Path
    model: Model
    cluster: Cluster

    def args(self, *extra: str) -> list[str]:
        return ["--model", str(self.model_path), "--cluster", str(self.cluster_path), "--profiles", str(self.profiles),
                *extra]


def profiled_degrees(model: Model) -> tuple[int, ...]:
    """Tensor degrees Megatron-LM can split this model's heads, query groups and FFN by."""
    return tuple(tp for tp in PROFILED_DEGREES if not (model.num_attention_heads % tp or model.num_query_groups % tp
                                                       or model.ffn_hidden_size % tp))


def write(spec: Spec, root: Path) -> Written:
    """Write the model, the cluster and a profile per GPU type: the bundled one of a bundled model, else a
    synthetic one (as `fasop profile synth` writes it)."""
    model_path, cluster_path, profiles = root / "model.toml", root / "cluster.toml", root / "profiles"
    profiles.mkdir(parents=True)
    model_path.write_text(toml_table("[model]", spec.model))
    cluster_path.write_text("\n".join([toml_table("[cluster]", spec.cluster)]
                                      + [toml_table("[[node_type]]", n) for n in spec.node_types]))
    model = load_model(str(model_path))
    if spec.measured:
        for gpu in {n["gpu"] for n in spec.node_types}:
            shutil.copy(bundled.data_dir("profiles") / model.name / f"{gpu}.csv", profiles / f"{gpu}.csv")
    tps = profiled_degrees(model)
    for gpu, efficiency in spec.efficiency.items():
        rows = synthesize(model, GPU_SPECS[gpu], tps, PROFILED_MBS, efficiency=efficiency)
        header = header_lines(model, GPU_SPECS[gpu], tps, PROFILED_MBS, efficiency=efficiency)
        (profiles / f"{gpu}.csv").write_text(format_profile(rows, header))
    return Written(root, model_path, cluster_path, profiles, model, load_cluster(str(cluster_path)))


@dataclass(frozen=True)
class ExplicitPlan:
    """A plan given by hand, as `fasop estimate` takes it, on all of a cluster's nodes."""

    tp: int
    dp: int
    pp: int
    mbs: int
    placement: list[str]
    layers: list[int]
    virtual_stages: int


def compositions(draw, total: int, parts: int, first_and_last_may_be_empty: bool) -> list[int]:
    """`total` layers over `parts` stages, each at least one (but perhaps the two ends)."""
    fewest = [1] * parts
    if first_and_last_may_be_empty:
        fewest[0] = fewest[-1] = 0
    spare = total - sum(fewest)
    cuts = sorted(draw(st.lists(st.integers(0, spare), min_size=parts - 1, max_size=parts - 1)))
    return [f + b - a for f, a, b in zip(fewest, [0, *cuts], [*cuts, spare])]


@st.composite
def explicit_plans(draw) -> tuple[Spec, ExplicitPlan]:
    """A random model with synthetic profiles, a cluster of 1 to 3 node types of at most 4 nodes, and a plan on
    all its nodes that fasop estimates: tensor degree, pipeline depth, layers per stage, micro-batch size, model
    chunks (interleaving only where Megatron-LM runs it: a multiple of the depth in micro-batches)."""
    model = draw(model_fields())
    head, nodes = draw(cluster_tables(model["precision"], most_nodes=4))
    gpn = nodes[0]["gpus_per_node"]
    world = gpn * sum(n["count"] for n in nodes)
    split = (model["num_attention_heads"], model["num_query_groups"], model["ffn_hidden_size"])
    tp = draw(st.sampled_from([t for t in PROFILED_DEGREES if gpn % t == 0 and not any(x % t for x in split)]))
    layers = num_layers(model)
    encoder_decoder = model["architecture"] == "encoder-decoder"
    most_stages = layers if encoder_decoder else layers + 2
    # pipelines three times in four where the GPUs allow one
    depths = [d for d in range(2, min(world // tp, most_stages) + 1) if world // tp % d == 0]
    pp = draw(st.sampled_from(depths)) if depths and draw(st.integers(0, 3)) else 1
    if pp == 1:
        per_stage = [layers]
    elif encoder_decoder:  # the encoder on the first stages, the decoder on the rest, each stage one at least
        encoder, decoder = model["encoder_num_layers"], model["decoder_num_layers"]
        encoder_stages = draw(st.integers(max(1, pp - decoder), min(encoder, pp - 1)))
        per_stage = (compositions(draw, encoder, encoder_stages, False)
                     + compositions(draw, decoder, pp - encoder_stages, False))
    else:  # the first and the last stage may hold only the embedding and the head
        per_stage = compositions(draw, layers, pp, pp > layers or draw(st.booleans()))
    v = 1 if encoder_decoder or pp == 1 else draw(st.sampled_from([1, 2, 3]))
    m = draw(st.integers(1, 4)) * (pp if v > 1 else 1)
    mbs = draw(st.sampled_from(PROFILED_MBS))
    dp = world // (tp * pp)
    model = {**model, "global_batch_size": dp * mbs * m}
    placement = [n["name"] for n in nodes for _ in range(n["count"])]
    efficiency = {gpu: draw(st.sampled_from([0.1, 0.5, 1.0])) for gpu in sorted({n["gpu"] for n in nodes})}
    return Spec(model, head, nodes, efficiency), ExplicitPlan(tp, dp, pp, mbs, draw(st.permutations(placement)),
                                                              per_stage, v)
