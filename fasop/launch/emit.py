"""`fasop emit`: Slurm and Megatron-LM launch scripts for one plan.

Three files are written for a plan:

* `sbatch.sh`: one Slurm job for the whole plan. Nodes are requested per node type with their GRES type; when
  the placement mixes node types, every run of consecutive nodes of one type becomes one component of a
  heterogeneous job (`#SBATCH hetjob`), in placement order. Slurm numbers the tasks of `srun --het-group=0-K`
  component by component, so the global task id (`SLURM_PROCID`) of the one task per node is the node's
  position in the plan's placement, and it becomes the torchrun node rank. The first node of component 0 is
  the rendezvous.
* `run_inter.sh`: the per-node launcher, `torchrun ... <entry script> <Megatron-LM flags>`.
* `plan.json`: the plan and its estimate, to compare the run with the prediction. `fasop emit` first estimates
  the plan afresh (`restate_plan`) and refuses a plan file whose figures disagree.

How the plan's per-stage layer counts reach Megatron-LM (stock flavour):

* even split: no flag (Megatron-LM's default split);
* otherwise, with `pipeline_split = "auto"`: `--decoder-first-pipeline-num-layers` /
  `--decoder-last-pipeline-num-layers` when the split has that shape (all middle stages equal, first and/or
  last different; Megatron core >= 0.9), else `--pipeline-model-parallel-layout` (Megatron core >= 0.13);
* encoder-decoder models: `--pipeline-model-parallel-split-rank` (Megatron-LM versions that still train
  encoder-decoder models with pipeline parallelism), which needs the encoder's layers split evenly over the
  encoder stages and the decoder's over the decoder stages; other splits are refused.

The `fasop-fork` flavour writes FASOP's `--balance k0-k1-...` (transformer layers per stage) instead.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from fasop.errors import InputError
from fasop.plans import PLAN_KEYS

ENTRY_SCRIPTS = {"decoder": "pretrain_gpt.py", "encoder": "pretrain_bert.py", "encoder-decoder": "pretrain_t5.py"}
FLAVORS = ("stock", "fasop-fork")
PIPELINE_SPLITS = ("auto", "layout", "first-last")
OUTPUT_FILES = ("sbatch.sh", "run_inter.sh", "plan.json")

# Characters Slurm reads unquoted in "#SBATCH --key=value" lines; always applied with fullmatch (a pattern
# ending in "$" would also accept a trailing newline, which ends the directive and starts a shell line).
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_SLURM_LIST = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")
_SLURM_TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}", re.ASCII)
_WORDPIECE = ("BertWordPieceLowerCase", "BertWordPieceCase")


@dataclass(frozen=True)
class LaunchOptions:
    """What differs between sites. Defaults may come from the cluster file's `[launch]` table."""

    partition: str | None = None  # Slurm partition for every node type
    partitions: Mapping[str, str] = field(default_factory=dict)  # node-type or GPU name -> partition
    gres_type: str | None = None  # GRES type for every node type
    gres_types: Mapping[str, str] = field(default_factory=dict)  # node-type or GPU name -> GRES type
    gpus_per_node: int | None = None  # override of the cluster's gpus_per_node
    cpus_per_task: int | None = None  # CPUs for the one task per node (torchrun and its workers)
    account: str | None = None
    exclusive: bool = True
    job_name: str | None = None  # default fasop-<model>
    time_limit: str = "01:00:00"
    megatron_path: str = "Megatron-LM"
    entry_script: str | None = None  # default by architecture; relative paths are inside megatron_path
    data_path: str | None = None  # None: --mock-data
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    container_image: str | None = None  # enroot/pyxis image; None: no container
    container_mounts: str | None = None  # pyxis --container-mounts, besides the run directory
    extra_flags: tuple[str, ...] = ()  # appended to the Megatron-LM flags (later flags win)
    train_iters: int = 50
    master_port: int = 6000
    megatron_flavor: str = "stock"
    pipeline_split: str = "auto"


# -- options --------------------------------------------------------------------------------------------


def _check_options(opts: LaunchOptions, where: str) -> None:
    def bad(key: str, problem: str) -> InputError:
        return InputError(f"{where}{key.replace('_', '-') if where == '--' else key}", problem)

    if opts.megatron_flavor not in FLAVORS:
        raise bad("megatron_flavor", f"expected one of {', '.join(FLAVORS)}, got {opts.megatron_flavor!r}")
    if opts.pipeline_split not in PIPELINE_SPLITS:
        raise bad("pipeline_split", f"expected one of {', '.join(PIPELINE_SPLITS)}, got {opts.pipeline_split!r}")
    for key in ("gpus_per_node", "cpus_per_task", "train_iters"):
        value = getattr(opts, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise bad(key, f"expected an integer >= 1, got {value!r}")
    port = opts.master_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise bad("master_port", f"expected a port number 1-65535, got {port!r}")
    if not isinstance(opts.time_limit, str) or not _SLURM_TIME.fullmatch(opts.time_limit):
        raise bad("time_limit", f"expected a Slurm time such as 90, 01:30:00 or 1-12:00:00, got {opts.time_limit!r}")
    def slurm_name(value: Any, pattern: re.Pattern, empty_ok: bool) -> bool:
        return isinstance(value, str) and (bool(pattern.fullmatch(value)) or (empty_ok and value == ""))

    for key, pattern in (("partition", _SLURM_LIST), ("gres_type", _SLURM_NAME), ("account", _SLURM_NAME),
                         ("job_name", _SLURM_NAME)):
        value = getattr(opts, key)
        if value is not None and not slurm_name(value, pattern, key == "gres_type"):
            raise bad(key, f"expected a Slurm name (letters, digits, _ . + -), got {value!r}")
    for key, pattern in (("partitions", _SLURM_LIST), ("gres_types", _SLURM_NAME)):
        for name, value in getattr(opts, key).items():
            if not slurm_name(value, pattern, key == "gres_types"):
                raise bad(f"{key[:-1]}.{name}", f"expected a Slurm name (letters, digits, _ . + -), got {value!r}")
    for key in ("megatron_path", "entry_script", "data_path", "tokenizer_type", "vocab_file", "merge_file",
                "tokenizer_model", "container_image", "container_mounts"):
        value = getattr(opts, key)
        if value is not None and (not isinstance(value, str) or not value or "\n" in value or "\0" in value):
            raise bad(key, f"expected a non-empty one-line string, got {value!r}")
    if not isinstance(opts.exclusive, bool):
        raise bad("exclusive", f"expected true or false, got {opts.exclusive!r}")
    if any(not isinstance(f, str) or "\n" in f or "\0" in f for f in opts.extra_flags):
        raise bad("extra_flags", "expected one-line strings")


def _str_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InputError(where, "expected a string or a table of strings keyed by node-type or GPU name")
    return dict(value)


def split_flags(value: Any, where: str) -> tuple[str, ...]:
    """Extra Megatron-LM flags: a list of arguments, or one string split as a shell would."""
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as err:
            raise InputError(where, f"cannot split {value!r} into arguments ({err})") from None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InputError(where, f"expected a string or a list of strings, got {value!r}")


LAUNCH_KEYS = (
    "partition", "gres_type", "gpus_per_node", "cpus_per_task", "account", "exclusive", "job_name", "time_limit",
    "megatron_path", "entry_script", "data_path", "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model",
    "container_image", "container_mounts", "extra_flags", "train_iters", "master_port", "megatron_flavor",
    "pipeline_split",
)


def launch_options(launch: Mapping[str, Any] | None = None, where: str = "[launch]", **overrides: Any) -> LaunchOptions:
    """LaunchOptions from a cluster's `[launch]` table, then `overrides` (None values are ignored).

    `partition` and `gres_type` in the table may be a string (every node type) or a table keyed by node-type
    or GPU name. Overrides `partitions` / `gres_types` are merged over the table's; `extra_flags` are appended
    to the table's.
    """
    launch = dict(launch or {})
    prefix = f"{where}."
    values: dict[str, Any] = {}
    for key, value in launch.items():
        if key not in LAUNCH_KEYS:
            raise InputError(f"{prefix}{key}", f"unknown key (known: {', '.join(sorted(LAUNCH_KEYS))})")
        if key in ("partition", "gres_type") and not isinstance(value, str):
            values[key + "s"] = _str_map(value, f"{prefix}{key}")
        elif key == "extra_flags":
            values[key] = split_flags(value, f"{prefix}{key}")
        else:
            values[key] = value
    opts = LaunchOptions(**values)
    _check_options(opts, prefix)
    known = {f.name for f in fields(LaunchOptions)}
    merged: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in known:
            raise TypeError(f"unknown launch option {key!r}")
        if value is None:
            continue
        if key in ("partitions", "gres_types"):
            merged[key] = {**getattr(opts, key), **value}
        elif key == "extra_flags":
            merged[key] = tuple(opts.extra_flags) + tuple(value)
        else:
            merged[key] = value
    opts = replace(opts, **merged)
    _check_options(opts, "--")
    return opts


# -- plans ----------------------------------------------------------------------------------------------


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse an output path that is a file, or a directory holding files unless `force`."""
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--out {out_dir}", "exists and is not a directory")
    if out_dir.is_dir() and not force and any(out_dir.iterdir()):
        raise InputError(f"--out {out_dir}", "the directory holds files already; pass --force to overwrite them")


# -- the plan, checked ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    rank: Any
    tp: int
    dp: int
    pp: int
    mbs: int
    gbs: int
    placement: tuple[str, ...]
    layers: tuple[int, ...]
    encoder_stages: int
    distributed_optimizer: bool
    gpus_per_node: int


def _positive(plan: Mapping[str, Any], key: str, where: str, minimum: int = 1) -> int:
    value = plan.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{where}: {key}", f"expected an integer >= {minimum}, got {value!r}")
    return value


def _check_plan(plan: Mapping[str, Any], model: Any, cluster: Any, opts: LaunchOptions, where: str) -> _Plan:
    missing = [key for key in PLAN_KEYS if key not in plan]
    if missing:
        raise InputError(where, f"not a fasop plan: lacks {', '.join(missing)}")
    tp, dp, pp, mbs, gbs = (_positive(plan, k, where) for k in ("tp", "dp", "pp", "mbs", "gbs"))
    placement = plan["placement"]
    if not isinstance(placement, list) or not placement or not all(isinstance(n, str) for n in placement):
        raise InputError(f"{where}: placement", f"expected a non-empty list of node-type names, got {placement!r}")
    layers = plan["layers_per_stage"]
    if (not isinstance(layers, list) or len(layers) != pp
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in layers)):
        raise InputError(f"{where}: layers_per_stage",
                         f"expected {pp} layer counts >= 0 (one per stage), got {layers!r}")
    total = model.encoder_num_layers + model.decoder_num_layers
    if sum(layers) != total:
        raise InputError(f"{where}: layers_per_stage",
                         f"holds {sum(layers)} layers, model {model.name} has {total}")
    if gbs % (mbs * dp):
        raise InputError(f"{where}: gbs", f"{gbs} is not a multiple of mbs x dp = {mbs * dp}")
    unknown = sorted(set(placement) - set(cluster.node_types))
    if unknown:
        known = ", ".join(cluster.node_types)
        raise InputError(f"{where}: placement", f"node type {unknown[0]} is not in cluster {cluster.name} (it has {known})")
    for name in sorted(set(placement)):
        used, have = placement.count(name), cluster.node_types[name].count
        if used > have:
            raise InputError(f"{where}: placement",
                             f"uses {used} nodes of type {name}, cluster {cluster.name} has {have}")
    if opts.gpus_per_node is not None:
        gpn = opts.gpus_per_node
    else:
        sizes = {cluster.node_types[name].gpus_per_node for name in placement}
        if len(sizes) > 1:
            raise InputError(f"{where}: placement", f"node types with different GPUs per node {sorted(sizes)}")
        gpn = sizes.pop()
        if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:  # written into the scripts as it is
            raise InputError(f"cluster {cluster.name}: gpus_per_node", f"expected an integer >= 1, got {gpn!r}")
    world = tp * dp * pp
    if world != gpn * len(placement):
        raise InputError(f"{where}: placement",
                         f"tp x dp x pp = {world} GPUs, but the placement lists {len(placement)} nodes of {gpn} GPUs")
    encoder_stages = plan.get("encoder_stages", 0) or 0
    if isinstance(encoder_stages, bool) or not isinstance(encoder_stages, int) or encoder_stages < 0:
        raise InputError(f"{where}: encoder_stages", f"expected an integer >= 0, got {encoder_stages!r}")
    if model.architecture == "encoder-decoder" and pp > 1:
        if not 1 <= encoder_stages < pp:
            raise InputError(f"{where}: encoder_stages",
                             f"expected 1 to {pp - 1} for an encoder-decoder plan with pp={pp}, got {encoder_stages}")
        if sum(layers[:encoder_stages]) != model.encoder_num_layers:
            raise InputError(f"{where}: layers_per_stage",
                             f"the first {encoder_stages} stages hold {sum(layers[:encoder_stages])} layers, "
                             f"the encoder has {model.encoder_num_layers}")
    distributed_optimizer = plan.get("distributed_optimizer", False)
    if not isinstance(distributed_optimizer, bool):
        raise InputError(f"{where}: distributed_optimizer", f"expected true or false, got {distributed_optimizer!r}")
    return _Plan(plan["rank"], tp, dp, pp, mbs, gbs, tuple(placement), tuple(layers), encoder_stages,
                 distributed_optimizer, gpn)


# -- the plan's figures, estimated afresh ----------------------------------------------------------------

FIGURE_TOLERANCE = 1e-6  # relative; a plan written by fasop search re-estimates to within rounding noise
_NOT_FIGURES = ("model", "model_file", "cluster", "cluster_file", "placement_search", "fits_memory")


def _disagreements(given: Any, fresh: Any, key: str) -> list[tuple[str, Any, Any]]:
    """(key, given, fresh) where `given` (read from a plan file) differs from `fresh`: numbers beyond
    FIGURE_TOLERANCE, everything else exactly; keys that `given` lacks are not compared."""
    if isinstance(fresh, dict) and isinstance(given, dict):
        return [d for k in fresh if k in given for d in _disagreements(given[k], fresh[k], f"{key}.{k}".lstrip("."))]
    if isinstance(fresh, list) and isinstance(given, list) and len(given) == len(fresh):
        return [d for i, (g, f) in enumerate(zip(given, fresh)) for d in _disagreements(g, f, f"{key}[{i}]")]
    if isinstance(fresh, float) and isinstance(given, (int, float)) and not isinstance(given, bool):
        agree = math.isclose(given, fresh, rel_tol=FIGURE_TOLERANCE, abs_tol=1e-12)
    else:
        agree = type(given) is type(fresh) and given == fresh
    return [] if agree else [(key, given, fresh)]


def restate_plan(plan: Mapping[str, Any], model: Any, cluster: Any, profiles_dir: str | None = None,
                 force: bool = False, where: str | None = None) -> tuple[dict, str | None]:
    """The plan to launch and a warning, its figures checked against an estimate made afresh from `model`,
    `cluster` and the profiles (a plan file may be edited by hand, or older than its inputs).

    Refuses a plan whose step time, memory, layer counts or any other figure it states disagrees with the fresh
    estimate (beyond FIGURE_TOLERANCE), or that no longer fits memory; with `force` such a plan is returned
    with the fresh figures, and a warning. Figures the plan file lacks are filled in from the estimate.
    """
    from fasop.search.engine import add_training_run, estimate  # the search modules load only when a plan is checked

    where = where or f"plan {plan.get('rank', '?')}"
    p = _check_plan(plan, model, cluster, LaunchOptions(), where)
    try:
        fresh = estimate(model, cluster, tp=p.tp, dp=p.dp, pp=p.pp, mbs=p.mbs, placement=list(p.placement),
                         layers=list(p.layers), gbs=p.gbs, profiles_dir=profiles_dir,
                         distributed_optimizer=p.distributed_optimizer)
    except InputError as err:
        raise InputError(where, f"cannot be estimated afresh from model {model.name} and cluster {cluster.name} "
                                f"({err})") from None
    if "train_steps" in plan:
        add_training_run(fresh, model, _positive(plan, "train_steps", where), None)
    figures = {key: value for key, value in fresh.items() if key not in _NOT_FIGURES}
    problems = []
    stale = _disagreements(plan, figures, "")
    if stale:
        key, given, value = stale[0]
        more = f" (and {len(stale) - 1} more figures)" if len(stale) > 1 else ""
        problems.append(f"{key} is {given!r} in the plan file but {value!r} estimated afresh{more}")
    if not fresh["fits_memory"]:
        problems.append(f"it no longer fits memory ({fresh['peak_memory_gib']:.2f} GiB x margin "
                        f"{cluster.memory_margin} on GPUs of {fresh['memory_capacity_gib']:.2f} GiB)")
    if not problems:
        return {**figures, **plan}, None
    message = "stale plan: " + "; ".join(problems)
    if not force:
        raise InputError(where, f"{message}; search again (with the same --profiles), or pass --force to emit "
                                "it with the fresh figures")
    return {**plan, **figures}, f"warning: {where}: {message}; emitted with the fresh figures (--force)"


# -- the pipeline split ---------------------------------------------------------------------------------


def pipeline_layout(layers: Sequence[int]) -> str:
    """Megatron core's `--pipeline-model-parallel-layout` for transformer layers per stage.

    Stages are separated by `|`; `E` is the embedding (first stage), `t` a transformer layer (`t*N` repeats
    it), `L` the loss (last stage); commas are cosmetic. [13, 5, 5, 1] -> "Et*13|t*5|t*5|t,L".
    """
    stages = []
    for index, count in enumerate(layers):
        text = "E" if index == 0 else ""
        if count == 1:
            text += "t"
        elif count > 1:
            text += f"t*{count}"
        if index == len(layers) - 1:
            text += ",L" if text else "L"
        stages.append(text)
    return "|".join(stages)


def first_last_split(layers: Sequence[int]) -> tuple[int | None, int | None] | None:
    """(first, last) for `--decoder-first/last-pipeline-num-layers` when the split has that form, else None.

    Megatron core gives the stages between the first and the last an equal share of the remaining layers and
    needs at least one layer on every stage it is told about; None in the pair: that flag is not needed.
    """
    if len(layers) < 2 or len(set(layers)) == 1:
        return None
    middle = layers[1:-1]
    share = middle[0] if middle else None
    if middle and (share < 1 or any(n != share for n in middle)):
        return None
    first = layers[0] if layers[0] != share else None
    last = layers[-1] if layers[-1] != share else None
    if (first is not None and first < 1) or (last is not None and last < 1):
        return None
    return first, last


def fasop_units_to_layers(units: Sequence[int], architecture: str, encoder_stages: int = 0) -> list[int]:
    """FASOP's partition units per stage -> transformer layers per stage (what `--balance` takes).

    FASOP counts the embedding as a unit of the first stage and the output head as a unit of the last stage
    (GPT, BERT); for T5 the second embedding unit is the decoder embedding, which sits in the first decoder
    stage (stage `encoder_stages`), and there is no head unit.
    """
    layers = list(units)
    if not layers:
        raise InputError("units", "expected at least one stage")
    if architecture == "encoder-decoder":
        if not 1 <= encoder_stages < len(layers) and len(layers) > 1:
            raise InputError("encoder_stages", f"expected 1 to {len(layers) - 1}, got {encoder_stages}")
        layers[0] -= 1
        layers[encoder_stages if len(layers) > 1 else 0] -= 1
    else:
        layers[0] -= 1
        layers[-1] -= 1
    if any(n < 0 for n in layers):
        raise InputError("units", f"{list(units)} leaves a stage with fewer than 0 transformer layers")
    return layers


def _split_flags(p: _Plan, model: Any, opts: LaunchOptions, where: str) -> list[tuple[str, ...]]:
    """The flags that tell Megatron-LM how many layers each pipeline stage holds."""
    if p.pp == 1:
        return []
    layers = list(p.layers)
    if opts.megatron_flavor == "fasop-fork":
        flags = [("--balance", "-".join(str(n) for n in layers))]
        if model.architecture == "encoder-decoder":
            flags.append(("--pipeline-model-parallel-split-rank", str(p.encoder_stages)))
        return flags
    if model.architecture == "encoder-decoder":
        if opts.pipeline_split != "auto":
            raise InputError("--pipeline-split", f"{opts.pipeline_split} applies to decoder and encoder models only; "
                             "encoder-decoder plans use --pipeline-model-parallel-split-rank")
        encoder, decoder = layers[:p.encoder_stages], layers[p.encoder_stages:]
        if len(set(encoder)) > 1 or len(set(decoder)) > 1:
            raise InputError(f"{where}: layers_per_stage",
                             f"encoder-decoder split {layers} (encoder stages {encoder}, decoder stages {decoder}) cannot be "
                             "run by stock Megatron-LM: --pipeline-model-parallel-split-rank splits the encoder's layers "
                             "evenly over the encoder stages and the decoder's over the rest, and the pipeline layout "
                             "has no encoder layers; use an even split or --megatron-flavor fasop-fork")
        return [("--pipeline-model-parallel-split-rank", str(p.encoder_stages))]
    if opts.pipeline_split == "layout":
        return [("--pipeline-model-parallel-layout", pipeline_layout(layers))]
    if len(set(layers)) == 1:
        return []
    first_last = first_last_split(layers)
    if first_last is not None:
        flags = []
        if first_last[0] is not None:
            flags.append(("--decoder-first-pipeline-num-layers", str(first_last[0])))
        if first_last[1] is not None:
            flags.append(("--decoder-last-pipeline-num-layers", str(first_last[1])))
        return flags
    if opts.pipeline_split == "first-last":
        raise InputError("--pipeline-split first-last",
                         f"split {layers} does not have that form (equal middle stages, first/last stages of >= 1 layer); "
                         "use --pipeline-split layout")
    return [("--pipeline-model-parallel-layout", pipeline_layout(layers))]


# -- Megatron-LM flags ----------------------------------------------------------------------------------


def _model_flags(model: Any, opts: LaunchOptions) -> list[tuple[str, ...]]:
    flags: list[tuple[str, ...]] = []
    if model.architecture == "encoder-decoder":
        flags += [("--encoder-num-layers", str(model.encoder_num_layers)),
                  ("--decoder-num-layers", str(model.decoder_num_layers))]
    else:
        flags.append(("--num-layers", str(model.encoder_num_layers + model.decoder_num_layers)))
    flags += [
        ("--hidden-size", str(model.hidden_size)),
        ("--num-attention-heads", str(model.num_attention_heads)),
        ("--kv-channels", str(model.kv_channels)),
        ("--ffn-hidden-size", str(model.ffn_hidden_size)),
    ]
    if model.architecture == "encoder-decoder":
        flags += [("--encoder-seq-length", str(model.encoder_seq_length)),
                  ("--decoder-seq-length", str(model.decoder_seq_length))]
        positions = max(model.encoder_seq_length, model.decoder_seq_length)
    else:
        positions = model.encoder_seq_length or model.decoder_seq_length
        flags.append(("--seq-length", str(positions)))
    flags.append(("--max-position-embeddings", str(positions)))
    newer = []  # flags that Megatron-LM gained after the FASOP fork was made
    if model.num_query_groups != model.num_attention_heads:
        newer.append(("--group-query-attention",))
        newer.append(("--num-query-groups", str(model.num_query_groups)))
    if model.ffn_activation == "swiglu":
        newer.append(("--swiglu",))
    if model.normalization == "rmsnorm":
        newer.append(("--normalization", "RMSNorm"))
    if model.position_embedding == "rope":
        newer.append(("--position-embedding-type", "rope"))
    elif model.position_embedding == "relative":
        newer.append(("--position-embedding-type", "relative"))
    if not model.tie_embeddings:
        newer.append(("--untie-embeddings-and-output-weights",))
    if not getattr(model, "linear_bias", True):
        newer.append(("--disable-bias-linear",))
    if newer and opts.megatron_flavor == "fasop-fork":
        names = ", ".join(f[0] for f in newer)
        raise InputError("--megatron-flavor fasop-fork",
                         f"model {model.name} needs {names}, which the FASOP fork (Megatron-LM of early 2023) lacks; use stock")
    flags += newer
    divisible = getattr(model, "make_vocab_size_divisible_by", 128)
    if divisible != 128:
        flags.append(("--make-vocab-size-divisible-by", str(divisible)))
    if not model.dropout:
        flags += [("--attention-dropout", "0"), ("--hidden-dropout", "0")]
    if model.precision in ("fp16", "bf16"):
        flags.append((f"--{model.precision}",))
    return flags


def _training_flags(opts: LaunchOptions) -> list[tuple[str, ...]]:
    return [
        ("--train-iters", str(opts.train_iters)),
        ("--lr", "0.00015"),
        ("--min-lr", "1.0e-5"),
        ("--lr-decay-style", "cosine"),
        ("--lr-warmup-fraction", "0.01"),
        ("--weight-decay", "0.01"),
        ("--clip-grad", "1.0"),
        ("--log-interval", "10"),
        ("--eval-iters", "0"),
    ]


def _data_flags(model: Any, opts: LaunchOptions) -> list[tuple[str, ...]]:
    fork = opts.megatron_flavor == "fasop-fork"
    if fork and (opts.data_path is None or (opts.vocab_file is None and opts.tokenizer_model is None)):
        raise InputError("--megatron-flavor fasop-fork",
                         "needs --data-path and --vocab-file (that Megatron-LM has no mock data and no null tokenizer)")
    flags: list[tuple[str, ...]] = []
    flags.append(("--data-path", opts.data_path) if opts.data_path else ("--mock-data",))
    tokenizer = opts.tokenizer_type
    if tokenizer is None and opts.vocab_file is not None:
        tokenizer = "GPT2BPETokenizer" if model.architecture == "decoder" else "BertWordPieceLowerCase"
    if tokenizer is None and opts.tokenizer_model is None:
        # NullTokenizer adds one end-of-document id to --vocab-size.
        flags += [("--tokenizer-type", "NullTokenizer"), ("--vocab-size", str(model.vocab_size - 1))]
        return flags
    if tokenizer is not None:
        flags.append(("--tokenizer-type", tokenizer))
    for flag, value in (("--vocab-file", opts.vocab_file), ("--merge-file", opts.merge_file),
                        ("--tokenizer-model", opts.tokenizer_model)):
        if value is not None:
            flags.append((flag, value))
    if model.architecture == "encoder-decoder" and tokenizer in _WORDPIECE:
        flags.append(("--vocab-extra-ids", "100"))  # T5's sentinel tokens
    return flags


# -- rendering ------------------------------------------------------------------------------------------


def _q(text: str) -> str:
    """One shell word holding exactly `text` (no expansion at run time)."""
    text = str(text)
    if "$" in text or "`" in text:  # double quotes with escapes read more plainly than '...$...' to linters
        return '"' + re.sub(r'([\\"$`])', r"\\\1", text) + '"'
    return shlex.quote(text)


def _array(name: str, flags: Iterable[Sequence[str]]) -> str:
    lines = [f"{name}=("]
    lines += ["    " + " ".join(_q(part) for part in flag) for flag in flags]
    lines.append(")")
    return "\n".join(lines)


def _group_flags(tokens: Sequence[str]) -> list[tuple[str, ...]]:
    """["--a", "1", "--b"] -> [("--a", "1"), ("--b",)]: one flag and its values per line."""
    groups: list[list[str]] = []
    for token in tokens:
        if not groups or token.startswith("-"):
            groups.append([token])
        else:
            groups[-1].append(token)
    return [tuple(g) for g in groups]


def _components(placement: Sequence[str]) -> list[tuple[str, int]]:
    """Runs of consecutive nodes of one type, in placement order: [small, big, big, small] -> 3 runs."""
    runs: list[tuple[str, int]] = []
    for name in placement:
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + 1)
        else:
            runs.append((name, 1))
    return runs


def _first(*values: str | None) -> str | None:
    return next((v for v in values if v is not None), None)


def _gres_type(node_type: Any, opts: LaunchOptions) -> str:
    """The node type's GRES type; "" asks for untyped GPUs (--gres=gpu:N)."""
    gres = _first(opts.gres_types.get(node_type.name), opts.gres_types.get(node_type.gpu),
                  getattr(node_type, "gres_type", None), opts.gres_type,
                  re.sub(r"[^a-z0-9_.+-]", "_", node_type.gpu.lower()))
    if gres and not _SLURM_NAME.fullmatch(gres):
        raise InputError(f"node_type.{node_type.name}: gres_type", f"expected a Slurm name, got {gres!r}")
    return gres


def _partition(node_type: Any, opts: LaunchOptions) -> str | None:
    part = _first(opts.partitions.get(node_type.name), opts.partitions.get(node_type.gpu),
                  getattr(node_type, "slurm_partition", None), opts.partition)
    if part is not None and not _SLURM_LIST.fullmatch(part):
        raise InputError(f"node_type.{node_type.name}: slurm_partition", f"expected a Slurm name, got {part!r}")
    return part


def _comment(text: str) -> str:
    """`text` made safe for a `# ...` line: a newline would end the comment and start a command (and end the
    #SBATCH directives), so it and every other unprintable character are written as escapes."""
    return "# " + "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _describe(plan: Mapping[str, Any], model: Any, cluster: Any, p: _Plan) -> str:
    return _comment(f"fasop plan {p.rank}: {model.name} on {cluster.name}, tp={p.tp} dp={p.dp} pp={p.pp} "
                    f"mbs={p.mbs} gbs={p.gbs}, layers per stage {'-'.join(str(n) for n in p.layers)}.")


def _sbatch(plan: Mapping[str, Any], model: Any, cluster: Any, p: _Plan, opts: LaunchOptions) -> str:
    runs = _components(p.placement)
    het = len(runs) > 1
    job_name = opts.job_name or re.sub(r"[^A-Za-z0-9_.+-]", "_", f"fasop-{model.name}")
    lines = [
        "#!/usr/bin/env bash",
        _describe(plan, model, cluster, p),
        _comment(f"Node ranks 0-{len(p.placement) - 1} in placement order: {' '.join(p.placement)}."),
    ]
    if het:
        lines.append("# One heterogeneous-job component per run of nodes of one type, in that order.")
    lines.append("# Submit from this directory: sbatch sbatch.sh (or: sbatch --chdir=DIR DIR/sbatch.sh).")
    for index, (name, count) in enumerate(runs):
        node_type = cluster.node_types[name]
        if index > 0:
            lines.append("#SBATCH hetjob")
        else:
            lines += [f"#SBATCH --job-name={job_name}", "#SBATCH --output=fasop-%j.out", "#SBATCH --error=fasop-%j.err"]
        lines.append(f"#SBATCH --time={opts.time_limit}")
        if opts.account:
            lines.append(f"#SBATCH --account={opts.account}")
        partition, gres = _partition(node_type, opts), _gres_type(node_type, opts)
        if partition:
            lines.append(f"#SBATCH --partition={partition}")
        lines += [f"#SBATCH --nodes={count}", "#SBATCH --ntasks-per-node=1",
                  f"#SBATCH --gres=gpu:{gres + ':' if gres else ''}{p.gpus_per_node}"]
        if opts.cpus_per_task:
            lines.append(f"#SBATCH --cpus-per-task={opts.cpus_per_task}")
        if opts.exclusive:
            lines.append("#SBATCH --exclusive")
    nodelist = "SLURM_JOB_NODELIST_HET_GROUP_0" if het else "SLURM_JOB_NODELIST"
    srun_args = ["--kill-on-bad-exit=1"]
    if het:
        srun_args.insert(0, f"--het-group=0-{len(runs) - 1}")
    lines += [
        "",
        "set -euo pipefail",
        "",
        'RUN_DIR="$PWD"',
        'if [[ ! -f "$RUN_DIR/run_inter.sh" ]]; then',
        '    echo "sbatch.sh: no run_inter.sh in $RUN_DIR; submit from the directory fasop emit wrote" >&2',
        "    exit 1",
        "fi",
        "",
        "# Rendezvous: the first node of the first component, which gets node rank 0.",
        f'MASTER_NODE="$(scontrol show hostnames "${nodelist}" | sed -n 1p)"',
        'MASTER_ADDR="$(scontrol -o show node "$MASTER_NODE" 2>/dev/null | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\' || true)"',
        'export MASTER_ADDR="${MASTER_ADDR:-$MASTER_NODE}"',
        f'export MASTER_PORT="${{MASTER_PORT:-{opts.master_port}}}"',
    ]
    if opts.cpus_per_task:
        lines.append(f"export SRUN_CPUS_PER_TASK={opts.cpus_per_task}")
    lines += ["", "# One task per node; its global task id (SLURM_PROCID) is its node rank.",
              "SRUN_ARGS=(" + " ".join(_q(a) for a in srun_args) + ")"]
    if opts.container_image:
        mounts = '"$RUN_DIR:$RUN_DIR"' + (f",{_q(opts.container_mounts)}" if opts.container_mounts else "")
        lines += [
            f"CONTAINER_IMAGE={_q(opts.container_image)}",
            f"CONTAINER_MOUNTS={mounts}",
            'SRUN_ARGS+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS" '
            '--container-workdir="$RUN_DIR")',
        ]
    lines += ['srun "${SRUN_ARGS[@]}" bash "$RUN_DIR/run_inter.sh"', ""]
    return "\n".join(lines)


def _run_inter(plan: Mapping[str, Any], model: Any, cluster: Any, p: _Plan, opts: LaunchOptions, where: str) -> str:
    entry = opts.entry_script or ENTRY_SCRIPTS[model.architecture]
    entry_value = _q(entry) if os.path.isabs(entry) else f'"$MEGATRON_PATH"/{_q(entry)}'
    parallel = [("--tensor-model-parallel-size", str(p.tp)), ("--pipeline-model-parallel-size", str(p.pp))]
    parallel += _split_flags(p, model, opts, where)
    if p.tp > 1:
        parallel.append(("--sequence-parallel",))
    if p.distributed_optimizer:
        parallel.append(("--use-distributed-optimizer",))
    parallel += [("--micro-batch-size", str(p.mbs)), ("--global-batch-size", str(p.gbs))]
    model_flags = _model_flags(model, opts)
    data_flags = _data_flags(model, opts)
    distributed = [("--nnodes", '"$NNODES"'), ("--nproc_per_node", '"$GPUS_PER_NODE"'),
                   ("--node_rank", '"$NODE_RANK"'), ("--master_addr", '"$MASTER_ADDR"'),
                   ("--master_port", '"$MASTER_PORT"')]
    lines = [
        "#!/usr/bin/env bash",
        _describe(plan, model, cluster, p),
        "# Per-node launcher, started once per node by sbatch.sh; by hand: NODE_RANK=r MASTER_ADDR=host bash run_inter.sh",
        "set -euo pipefail",
        "",
        f"NNODES={len(p.placement)}",
        f"GPUS_PER_NODE={p.gpus_per_node}",
        "NODE_TYPES=(" + " ".join(_q(n) for n in p.placement) + ")",
        'NODE_RANK="${SLURM_PROCID:-${NODE_RANK:-}}"',
        'if [[ ! "$NODE_RANK" =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then',
        '    echo "run_inter.sh: node rank \'$NODE_RANK\' is not 0 to $((NNODES - 1)); start under srun or set NODE_RANK" >&2',
        "    exit 1",
        "fi",
        'MASTER_ADDR="${MASTER_ADDR:?run_inter.sh: set MASTER_ADDR to the address of node rank 0}"',
        f'MASTER_PORT="${{MASTER_PORT:-{opts.master_port}}}"',
        f"DEFAULT_MEGATRON_PATH={_q(opts.megatron_path)}",
        'MEGATRON_PATH="${MEGATRON_PATH:-$DEFAULT_MEGATRON_PATH}"',
        f"ENTRY_SCRIPT={entry_value}",
        'echo "run_inter.sh: node rank $NODE_RANK of $NNODES (plan: ${NODE_TYPES[$NODE_RANK]}) on $(hostname), '
        'rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "",
        "DISTRIBUTED_ARGS=(",
        *[f"    {flag} {value}" for flag, value in distributed],
        ")",
        _array("PARALLEL_ARGS", parallel),
        _array("MODEL_ARGS", model_flags),
        _array("TRAINING_ARGS", _training_flags(opts)),
        _array("DATA_ARGS", data_flags),
        _array("EXTRA_ARGS", _group_flags(opts.extra_flags)),
        "",
        'exec torchrun "${DISTRIBUTED_ARGS[@]}" "$ENTRY_SCRIPT" \\',
        '    "${PARALLEL_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${EXTRA_ARGS[@]}"',
        "",
    ]
    return "\n".join(lines)


def render_plan(plan: Mapping[str, Any], model: Any, cluster: Any, options: LaunchOptions | None = None,
                where: str | None = None) -> dict[str, str]:
    """The emitted files, name -> text, without writing anything."""
    opts = options or LaunchOptions()
    _check_options(opts, "--")
    where = where or f"plan {plan.get('rank', '?')}"
    p = _check_plan(plan, model, cluster, opts, where)
    return {
        "sbatch.sh": _sbatch(plan, model, cluster, p, opts),
        "run_inter.sh": _run_inter(plan, model, cluster, p, opts, where),
        "plan.json": json.dumps(plan, indent=2, sort_keys=True) + "\n",
    }


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_files(out_dir: Path, files: Mapping[str, str], force: bool = False) -> list[Path]:
    """Write `files` into `out_dir` through a temporary sibling, so a failure leaves no half-written output."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, force)
    parent = out_dir.absolute().parent
    mask = _umask()
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=parent))
    except OSError as err:
        raise InputError(f"--out {out_dir}", f"cannot create a directory beside it ({err.strerror})") from None
    try:
        for name, text in files.items():
            path = tmp / name
            path.write_text(text, encoding="utf-8")
            os.chmod(path, (0o777 if name.endswith(".sh") else 0o666) & ~mask)
        if out_dir.is_dir():
            for name in files:
                os.replace(tmp / name, out_dir / name)
            tmp.rmdir()
        else:
            os.chmod(tmp, 0o777 & ~mask)
            os.rename(tmp, out_dir)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InputError(f"--out {out_dir}", f"cannot write ({err.strerror or err})") from None
    return [out_dir / name for name in files]


def emit_plan(plan: Mapping[str, Any], model: Any, cluster: Any, out_dir: Path, options: LaunchOptions | None = None,
              force: bool = False, where: str | None = None) -> list[Path]:
    """Write sbatch.sh, run_inter.sh and plan.json for `plan` into `out_dir`; returns the written paths."""
    check_out_dir(Path(out_dir), force)
    files = render_plan(plan, model, cluster, options, where)
    return write_files(Path(out_dir), files, force)
