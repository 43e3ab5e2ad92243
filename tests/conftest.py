"""Shared fixtures: a click runner and a factory for a tiny model, its profiles and a two-node cluster.

The tiny inputs use round numbers so that tests can reason about them: a 4-layer decoder (hidden 64,
4 heads, sequence 32, vocabulary 1000, global batch 8, fp16), profiled on two GPU types "fast" and "slow"
at tensor degrees 1 and 2 (micro-batch size 1 only), on a cluster of one "fast" and one "slow" node with
2 GPUs each and 16 GiB per GPU, links without latency (times stay proportional to bytes and profile times).
Every part can be overridden or broken on purpose.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

# -- the tiny model -------------------------------------------------------------------------------------
TINY_MODEL = {
    "name": "tiny",
    "source": "made-up round numbers for tests",
    "architecture": "decoder",
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "vocab_size": 1000,
    "tie_embeddings": True,
    "position_embedding": "learned",
    "normalization": "layernorm",
    "ffn_activation": "gelu",
    "flash_attention": False,
    "dropout": True,
    "linear_bias": True,
    "precision": "fp16",
    "global_batch_size": 8,
}

# -- its profiles: seconds of one unit for one micro-batch on the "slow" GPU; "fast" takes half -------------
SLOW_TIMES = {  # kind: (forward_s, backward_s)
    "embedding": (0.002, 0.004),
    "layer": (0.010, 0.020),
    "head": (0.004, 0.008),
}
GPU_SPEED = {"slow": 1.0, "fast": 0.5}
PROFILE_HEADER = "tp,mbs,kind,forward_s,backward_s"

# -- the cluster ------------------------------------------------------------------------------------------
TINY_CLUSTER = {
    "name": "tiny-cluster",
    "description": "one fast and one slow node of 2 GPUs",
    "memory_margin": 1.1,
    "gpu_memory_overhead_gib": 0.0,  # the tests' memory sizes are tiny: nothing held back
}
# Both GPUs' memory at the largest bandwidth a cluster file takes (1 PB/s): the optimizer step, 1e-8 s, stays out
# of the round numbers.
TINY_NODE_TYPES = {
    "fast": {
        "name": "fast", "gpu": "fast", "instance": "test-fast", "gpus_per_node": 2, "gpu_memory_gib": 16.0,
        "gpu_memory_bandwidth": "1000 TB/s",
        "intra_node_bandwidth": "800 Gbit/s", "inter_node_bandwidth": "100 Gbit/s",
        "intra_node_latency_us": 0.0, "inter_node_latency_us": 0.0,
        "price_per_hour_usd": 4.0, "price_source": "round number for tests", "price_date": "2024-01-01",
        "count": 1,
    },
    "slow": {
        "name": "slow", "gpu": "slow", "instance": "test-slow", "gpus_per_node": 2, "gpu_memory_gib": 16.0,
        "gpu_memory_bandwidth": "1000 TB/s",
        "intra_node_bandwidth": "200 Gbit/s", "inter_node_bandwidth": "50 Gbit/s",
        "intra_node_latency_us": 0.0, "inter_node_latency_us": 0.0,
        "price_per_hour_usd": 2.0, "price_source": "round number for tests", "price_date": "2024-01-01",
        "count": 1,
    },
}


def without_optimizer_step(cluster):
    """The cluster with GPU memory of unlimited bandwidth: no optimizer step, for properties of the pipeline
    alone."""
    return replace(cluster, node_types={name: replace(t, gpu_memory_bytes_per_s=math.inf)
                                        for name, t in cluster.node_types.items()})


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for plain text
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def toml_table(header: str, fields: dict[str, Any]) -> str:
    lines = [header] + [f"{key} = {toml_value(value)}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def gpu_table(name: str, **changes) -> str:
    """A [[gpu]] spec table for the tiny clusters' GPU types, which the catalogue lacks."""
    fields = {"name": name, "dense_fp16_tflops": 100.0, "dense_bf16_tflops": 100.0, "memory_gib": 16.0,
              "memory_bandwidth_gb_per_s": 1000.0, "intra_node_link": "25 GB/s", "matmul_efficiency": 0.5,
              "source": "round numbers for tests", "date": "2026-01-01", **changes}
    return "\n" + toml_table("[[gpu]]", fields)


LLAMA_STYLE = {"architecture": "decoder", "seq_length": 2048, "vocab_size": 32000, "tie_embeddings": False,
               "position_embedding": "rope", "normalization": "rmsnorm", "ffn_activation": "swiglu",
               "linear_bias": False, "flash_attention": True, "dropout": False, "precision": "bf16"}


def llama_toml(**fields: Any) -> str:
    """A model file of a Llama-style decoder (rotary positions, RMSNorm, SwiGLU, no biases, bf16): `fields` give
    its name and shape and override the rest (None leaves a field out)."""
    return toml_table("[model]", merged(LLAMA_STYLE, fields))


def one_line_error(result, *fragments: str) -> str:
    """A command refused as bad input must be: exit code 2, one `Error:` line on stderr naming each fragment, no
    traceback. Returns that line."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def merged(base: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """`base` with `overrides` applied; an override of None removes the key."""
    result = dict(base)
    for key, value in (overrides or {}).items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def model_toml(overrides: dict[str, Any] | None = None) -> str:
    return toml_table("[model]", merged(TINY_MODEL, overrides))


def cluster_toml(overrides: dict[str, Any] | None = None,
                 node_overrides: dict[str, dict[str, Any]] | None = None, extra: str = "") -> str:
    parts = [toml_table("[cluster]", merged(TINY_CLUSTER, overrides))]
    for name, fields in TINY_NODE_TYPES.items():
        parts.append(toml_table("[[node_type]]", merged(fields, (node_overrides or {}).get(name))))
    return "\n".join(parts) + extra


def profile_csv(gpu: str, tps: tuple[int, ...] = (1, 2), kinds: tuple[str, ...] = tuple(SLOW_TIMES)) -> str:
    """Rows for every tp in `tps` and kind in `kinds` at micro-batch size 1; tp=2 takes 60% of tp=1."""
    lines = [f"# {gpu}: round numbers for tests", PROFILE_HEADER]
    for tp in tps:
        for kind in kinds:
            forward, backward = SLOW_TIMES[kind]
            scale = GPU_SPEED[gpu] * (1.0 if tp == 1 else 0.6)
            lines.append(f"{tp},1,{kind},{forward * scale:.6g},{backward * scale:.6g}")
    return "\n".join(lines) + "\n"


@dataclass
class Tiny:
    """Paths of one set of tiny inputs."""

    root: Path
    model: Path
    cluster: Path
    profiles: Path

    def args(self, *extra: str) -> list[str]:
        """--model, --cluster and --profiles options for these inputs, then `extra`."""
        return ["--model", str(self.model), "--cluster", str(self.cluster), "--profiles", str(self.profiles), *extra]


@pytest.fixture
def runner() -> CliRunner:
    """A click runner. click >= 8.2 always keeps stderr apart: `result.stdout`, `result.stderr`, and
    `result.output` (both, interleaved as a terminal shows them)."""
    return CliRunner()


@pytest.fixture
def tiny(tmp_path):
    """Factory: tiny(name="tiny", model=..., cluster=..., nodes=..., cluster_extra=..., tps=..., profiles=...).

    model / cluster: field overrides of the [model] / [cluster] table (None removes a field), or a whole
    file's text as a string. nodes: {"fast": {...}, "slow": {...}} overrides of the node types.
    cluster_extra: TOML text appended to the cluster file. tps: tensor degrees profiled for both GPU types.
    profiles: {"fast": text} replaces a profile file's text; a value of None leaves the file out.
    Each call writes into its own folder tmp_path/<name> and returns a `Tiny` of the paths.
    """

    def make(name: str = "tiny", *, model: dict | str | None = None, cluster: dict | str | None = None,
             nodes: dict | None = None, cluster_extra: str = "", tps: tuple[int, ...] = (1, 2),
             profiles: dict[str, str | None] | None = None) -> Tiny:
        root = tmp_path / name
        folder = root / "profiles"
        folder.mkdir(parents=True)
        model_path, cluster_path = root / "model.toml", root / "cluster.toml"
        model_path.write_text(model if isinstance(model, str) else model_toml(model))
        cluster_path.write_text(cluster if isinstance(cluster, str) else cluster_toml(cluster, nodes, cluster_extra))
        texts: dict[str, str | None] = {gpu: profile_csv(gpu, tps) for gpu in GPU_SPEED}
        texts.update(profiles or {})
        for gpu, text in texts.items():
            if text is not None:
                (folder / f"{gpu}.csv").write_text(text)
        return Tiny(root, model_path, cluster_path, folder)

    return make


@pytest.fixture(scope="module")
def validate_published():
    """scripts/validate_published.py imported as a module (a script, not part of the package)."""
    name = "validate_published_script"
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" /
                                                  "validate_published.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name while the file runs
    spec.loader.exec_module(module)
    yield module
    del sys.modules[name]
