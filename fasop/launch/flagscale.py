"""`fasop emit` for stage-group plans: FlagScale's heterogeneous training (a Megatron-LM fork), whose pipeline
stages may differ in GPU type, tensor- and data-parallel degree and micro-batch.

* Meshes (flagscale_meshes): consecutive stages of one node type, tp, dp and micro-batch form one mesh
  `[tp, cp=1, ep=1, dp, pp=stages]`, labelled by node type. FlagScale gives ranks to meshes in the order of
  their label's first place in `hetero_device_types`, then in host order, so a node type that comes back
  after another (A, B, A) takes a label of its own (A, B, A_2): every mesh then gets its own nodes.
* Hosts (flagscale_hosts): the physical nodes, a hostfile line each with one label and the environment of its
  label (its GPUs in rank order): a node holding several GPU kinds runs consecutive stages, kind by kind.
* Rules (flagscale_errors): what FlagScale asserts of a plan (its pre_validate_args and RankMapper).
* Files (render_flagscale): `flagscale.yaml` (the experiment: runner, per-label environment), `train/fasop.yaml`
  (the training: parallelism, hetero meshes, model shape from fasop.launch.megatron, data, checkpoints as
  torch files, as hetero runs do not fully support distributed checkpoints: FlagScale issue #319), `sbatch.sh`
  and `plan.json`; flagscale_launcher_files swaps sbatch.sh for the ssh or manual launcher's files
  (fasop.launch.flagscale_scripts).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fasop.cost.stagegroups import host_labels, host_types, node_hosts
from fasop.errors import ArgumentError, InputError
from fasop.files import comment_line
from fasop.inputs.names import NAME, NAME_RULE
from fasop.launch.flagscale_scripts import CONFIG_NAME, commands_text, hostfile_text, launch_text, sbatch_text
from fasop.launch.launchers import hosts_text, read_hosts
from fasop.launch.megatron import data_flags, model_flags, training_flags
from fasop.launch.network import SHARED_FABRIC, network_env
from fasop.launch.options import LaunchOptions, check_options
from fasop.launch.resume import exit_duration_min
from fasop.launch.shell import assignment, group_flags
from fasop.launch.yamltext import yaml_text
from fasop.plans import Plan
from fasop.search.precision import plan_model

TRAIN_NAME = "fasop"  # the training config, train/fasop.yaml
ENTRYPOINT = "./flagscale/train/train_gpt.py"  # in the FlagScale checkout
# Strings FlagScale's runner passes through shlex.join into `cmd="..."` lines of the scripts it writes: shlex's
# unquoted characters, as a quoted word would break out of those double quotes (and a quoted NAME=VALUE would
# no longer be an assignment)
FLAGSCALE_WORD = re.compile(r"[\w@%+=:,./-]*", re.ASCII)
# The flags FlagScale's runner sets itself (the checkpoint folders: under system.checkpoint)
_RUNNER_FLAGS = ("--save", "--load")
_PRECISION = ("fp16", "bf16", "fp8_format", "fp8_recipe", "fp8_param_gather")


@dataclass(frozen=True)
class Mesh:
    """One FlagScale process mesh: consecutive stages on nodes of one type with equal tp, dp and mbs."""

    node_type: str
    label: str  # its device-type label in hetero_device_types and the hostfile
    tp: int
    dp: int
    mbs: int  # each GPU's micro-batch
    layers: tuple[int, ...]  # of each of its stages

    @property
    def pp(self) -> int:
        return len(self.layers)

    @property
    def process_mesh(self) -> list[int]:
        return [self.tp, 1, 1, self.dp, self.pp]


def _stage_node_type(plan: Plan, index: int) -> str:
    return plan.placement[(plan.stages or [])[index].nodes[0]]


def flagscale_meshes(plan: Plan) -> list[Mesh]:
    """The meshes of a stage-group plan that flagscale_errors passes, in pipeline order, with their labels."""
    stages = plan.stages or []
    keys = [(_stage_node_type(plan, i), s.tp, s.dp, s.mbs or plan.mbs * plan.dp // (s.dp or 1))
            for i, s in enumerate(stages)]
    groups: list[tuple[tuple[Any, ...], list[int]]] = []
    for key, stage in zip(keys, stages):
        if groups and groups[-1][0] == key:
            groups[-1][1].append(stage.layers)
        else:
            groups.append((key, [stage.layers]))
    meshes: list[Mesh] = []
    taken = set(plan.placement)
    for (node_type, tp, dp, mbs), layers in groups:
        label = node_type
        if meshes and meshes[-1].node_type != node_type and any(m.node_type == node_type for m in meshes):
            number = 2
            while f"{node_type}_{number}" in taken:
                number += 1
            label = f"{node_type}_{number}"
            if not NAME.fullmatch(label):
                raise InputError(f"placement: {node_type}", f"its device-type label {label!r} is not {NAME_RULE}; "
                                                            "shorten the node-type name")
        elif meshes and meshes[-1].node_type == node_type:
            label = meshes[-1].label
        taken.add(label)
        meshes.append(Mesh(node_type, label, tp, dp, mbs, tuple(layers)))
    return meshes


def _stage_errors(plan: Plan) -> list[str]:
    """Each stage on nodes of one type, the stages in node-rank order (FlagScale places ranks in host order)."""
    errors = []
    next_node = 0
    for index, stage in enumerate(plan.stages or []):
        types = sorted({plan.placement[n] for n in stage.nodes if n < len(plan.placement)})
        if len(types) != 1 or any(n >= len(plan.placement) for n in stage.nodes):
            errors.append(f"stage {index} must lie on nodes of the placement of one node type (a mesh has one "
                          f"device type), not on nodes {stage.nodes}")
        elif stage.nodes != list(range(next_node, next_node + len(stage.nodes))):
            errors.append(f"stage {index} must take node ranks {next_node} and on in pipeline order (FlagScale gives "
                          f"ranks in host order), not {stage.nodes}")
        next_node += len(stage.nodes)
    if next_node != len(plan.placement):
        errors.append(f"the stages take {next_node} nodes, the placement has {len(plan.placement)}")
    return errors


def flagscale_errors(plan: Plan, model: Any) -> list[str]:
    """Every rule of FlagScale's heterogeneous mode that `plan` breaks, one line each (empty: it can run)."""
    if not plan.is_stage_groups or not plan.stages:
        return ["FlagScale's heterogeneous mode runs stage-group plans (kind stage-groups)"]
    stages = plan.stages
    errors = []
    if model.architecture != "decoder":
        errors.append(f"model {model.name} is {model.architecture}: FlagScale's heterogeneous mode trains GPT-style "
                      "(decoder) models")
    if plan.virtual_stages not in (None, 1):
        errors.append(f"virtual_stages is {plan.virtual_stages}: hetero mode has no interleaved (virtual) pipeline")
    layers = list(plan.layers_per_stage)
    if len(layers) != plan.pp or len(stages) != plan.pp or [s.layers for s in stages] != layers:
        errors.append(f"the layer split {layers} needs one entry per stage, pp = {plan.pp}, equal to the stages' layers")
    if sum(layers) != model.num_layers:
        errors.append(f"the layer split {layers} sums to {sum(layers)}, not the model's {model.num_layers} layers")
    first = stages[0]
    if (first.tp, first.dp) != (plan.tp, plan.dp):
        errors.append(f"the plan's tp {plan.tp} and dp {plan.dp} must be the first stage's ({first.tp}, {first.dp})")
    batch = plan.dp * plan.mbs  # the global micro-batch, dp0 x mbs0, the same on every mesh
    for index, stage in enumerate(stages):
        dp = stage.dp or 1
        if batch % dp:
            errors.append(f"the global micro-batch dp x mbs = {batch} is not divisible by stage {index}'s dp {dp}")
        elif stage.mbs is not None and stage.mbs * dp != batch:
            errors.append(f"stage {index}'s micro-batch {stage.mbs} x dp {dp} is not the global micro-batch {batch}")
    if plan.gbs % batch:
        errors.append(f"gbs {plan.gbs} is not a multiple of the global micro-batch dp x mbs = {batch}")
    if model.tie_embeddings:
        errors += _tied_embedding_errors(plan, model)
    return errors + _stage_errors(plan)


def _tied_embedding_errors(plan: Plan, model: Any) -> list[str]:
    first, last = (plan.stages or [])[0], (plan.stages or [])[-1]
    if first.tp != last.tp:
        return [f"tied embeddings need the first and last stage's tp equal, not {first.tp} and {last.tp} (or untie "
                "them: tie_embeddings = false)"]
    if first.dp != last.dp and plan.distributed_optimizer:
        small, large = sorted((first.dp or 1, last.dp or 1))
        if large % small:
            return [f"tied embeddings with the distributed optimizer need one of the first and last stage's dp "
                    f"({first.dp}, {last.dp}) to divide the other"]
        rows = model.padded_vocab(first.tp) // first.tp
        if rows % large:  # the partial reduce gives each data-parallel rank an equal slice of the rows
            return [f"the shared embedding's {rows} rows per tensor-parallel rank do not split over dp {large}"]
    return []


def partial_reduce(plan: Plan, model: Any) -> bool:
    """FlagScale's use_partial_reduce_for_shared_embedding: tied embeddings whose first and last stage differ in
    dp, with the distributed optimizer."""
    first, last = (plan.stages or [])[0], (plan.stages or [])[-1]
    return bool(model.tie_embeddings and first.dp != last.dp and plan.distributed_optimizer)


@dataclass(frozen=True)
class Host:
    """One physical node of a FlagScale run, a line of its hostfile."""

    node_type: str  # as hosts files and Slurm name it: a node holding several GPU kinds by its [[node_type]] name
    slots: int  # the GPUs the plan runs on it
    label: str  # its device-type label, one of the meshes' on it
    env: tuple[tuple[str, str], ...]  # what its label exports: its GPUs in rank order, its network settings


def flagscale_hosts(plan: Plan, cluster: Any, meshes: Sequence[Mesh], where: str) -> list[Host]:
    """The plan's physical nodes in host order, each with its label (fasop.cost.stagegroups.host_labels) and
    that label's environment; every stage must fill whole nodes (or, on a node holding several GPU kinds, its
    kind's GPUs: fasop.cost.stagegroups.node_hosts)."""
    position_label = []
    for mesh in meshes:
        gpus = cluster.node_types[mesh.node_type].gpus_per_node
        if (mesh.tp * mesh.dp) % gpus:
            raise InputError(f"{where}: stages", f"a stage of tp {mesh.tp} x dp {mesh.dp} on {mesh.node_type} does not "
                                                 f"fill whole nodes of {gpus} GPUs")
        position_label += [[m.label for m in meshes].index(mesh.label)] * (mesh.tp * mesh.dp // gpus * mesh.pp)
    placement = plan.placement
    chosen = host_labels(cluster, placement, position_label)
    if chosen is None:
        raise InputError(f"{where}: placement", "FlagScale gives a host one label and every host of a label one "
                                                "environment: no labels give each node of this plan the GPUs it runs")
    host_of = node_hosts(cluster, placement)
    fabrics = {t.network.fabric for t in (cluster.hosts.get(n) or cluster.node_types[n] for n in
                                          host_types(cluster, placement)) if t.network is not None}
    hosts: list[Host] = []
    for host, label in enumerate(chosen):
        blocks = [cluster.node_types[name] for name, h in zip(placement, host_of) if h == host]
        whole = cluster.hosts.get(blocks[0].host) or blocks[0]
        devices = [d for b in blocks for d in range(b.host_first_gpu, b.host_first_gpu + b.gpus_per_node)]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
        if blocks[0].host:  # nvidia-smi's indices; CUDA's own order puts the fastest kind first
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if whole.network is not None:  # node types of different fabrics all use TCP sockets
            env.update(network_env(whole, SHARED_FABRIC if len(fabrics) > 1 else whole.network.fabric))
        hosts.append(Host(whole.name, len(devices), meshes[label].label, tuple(sorted(env.items()))))
    return hosts


def flagscale_nodes(hosts: Sequence[Host]) -> list[tuple[str, int, str]]:
    """(node type, GPUs, label) of each host, as the launchers' scripts take them."""
    return [(host.node_type, host.slots, host.label) for host in hosts]


def _entries(flags: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Megatron-LM flags as config keys, as FlagScale's runner turns them back: `--num-layers 8` is
    num_layers: 8, `--swiglu` is swiglu: true, several values a list."""
    entries: dict[str, Any] = {}
    for flag in flags:
        values = [int(v) if v.isascii() and v.isdigit() else v for v in flag[1:]]
        entries[flag[0].removeprefix("--").replace("-", "_")] = (True if not values else values[0]
                                                                 if len(values) == 1 else values)
    return entries


def _check_words(value: Any, key: str, where: str) -> None:
    """Every string of a config: one that FlagScale's runner writes into its scripts unharmed."""
    if isinstance(value, Mapping):
        for name, item in value.items():
            _check_words(item, f"{key}.{name}" if key else str(name), where)
    elif isinstance(value, list):
        for item in value:
            _check_words(item, key, where)
    elif isinstance(value, str) and not FLAGSCALE_WORD.fullmatch(value):
        raise InputError(f"{where}: {key}", f"{value!r}: FlagScale's runner writes it into a shell command unquoted; "
                                            "expected letters, digits and _ @ % + = : , . / -")


def train_config(plan: Plan, model: Any, meshes: Sequence[Mesh], opts: LaunchOptions) -> dict[str, Any]:
    """train/fasop.yaml: FlagScale's `system`, `model` and `data` sections."""
    hetero: dict[str, Any] = {
        "enable_hetero": True,
        "hetero_current_device_type": meshes[0].label,  # the runner sets each host's from its hostfile type
        "hetero_device_types": [m.label for m in meshes],
        "hetero_process_meshes": [n for m in meshes for n in m.process_mesh],
        "hetero_pipeline_layer_split": list(plan.layers_per_stage),
        "hetero_use_cpu_communication": False,
        "standalone_embedding_stage": False,
    }
    if partial_reduce(plan, model):
        hetero["use_partial_reduce_for_shared_embedding"] = True
    shape = _entries(model_flags(model, opts))
    training = _entries([f for f in training_flags(plan, model, opts) if f[0] not in _RUNNER_FLAGS])
    system: dict[str, Any] = {
        "tensor_model_parallel_size": plan.tp,  # mesh 0's; each rank takes its own mesh's
        "pipeline_model_parallel_size": plan.pp,
        "sequence_parallel": bool(plan.sequence_parallel),
        "use_distributed_optimizer": bool(plan.distributed_optimizer),
        "overlap_grad_reduce": bool(plan.overlap_grad_reduce),
        "overlap_param_gather": bool(plan.overlap_param_gather),
        "hetero": hetero,
    }
    if plan.tp_comm_overlap:
        system["tp_comm_overlap"] = True
    if plan.recompute not in (None, "none"):
        system["recompute"] = {"recompute_granularity": plan.recompute}
        if plan.recompute == "full":
            system["recompute"].update(recompute_method=plan.recompute_method,
                                       recompute_num_layers=plan.recompute_num_layers)
        elif plan.recompute_modules:
            system["recompute"]["recompute_modules"] = list(plan.recompute_modules)
    system["precision"] = {key: shape.pop(key) for key in _PRECISION if key in shape}
    system["logging"] = {"log_interval": training.pop("log_interval")}
    # the launchers override save and load with paths in the run directory
    system["checkpoint"] = {"save": opts.checkpoint_dir, "load": opts.checkpoint_dir, "ckpt_format": "torch",
                            "save_interval": training.pop("save_interval", training["train_iters"])}
    if training.pop("exit_signal_handler", False):
        system["checkpoint"]["exit_signal_handler"] = True
    model_section = {**shape, "micro_batch_size": plan.mbs, "global_batch_size": plan.gbs, **training,
                     **_entries(group_flags(opts.extra_flags))}
    return {"system": system, "model": model_section, "data": _entries(data_flags(model, opts))}


def experiment_config(meshes: Sequence[Mesh], hosts: Sequence[Host], opts: LaunchOptions) -> dict[str, Any]:
    """flagscale.yaml: the experiment (run.py's config): the runner, and each host label's environment."""
    per_label = {m.label: dict(host.env) for m in meshes for host in hosts if host.label == m.label}
    # What every label shares is exported by the node script's first lines (quoted here: the runner would quote
    # `NAME=^lo` whole, which is then no assignment); the rest goes through the runner, per label. A value the
    # runner cannot pass (NCCL's `^lo,docker`) that every label setting it agrees on is exported on every node:
    # the interface exclusions of the fabric defaults harm no node that sets none.
    values: dict[str, set[str]] = {}
    for env in per_label.values():
        for key, value in env.items():
            values.setdefault(key, set()).add(value)
    shared = {key: next(iter(found)) for key, found in values.items() if key != "CUDA_VISIBLE_DEVICES"
              and len(found) == 1 and (all(key in env for env in per_label.values())
                                       or not FLAGSCALE_WORD.fullmatch(next(iter(found))))}
    per_label = {label: {k: v for k, v in sorted(env.items()) if k not in shared} for label, env in per_label.items()}
    exports = [f"export {assignment(key, value)}" for key, value in sorted(shared.items())]
    return {
        "defaults": [{"train": TRAIN_NAME}, "_self_"],
        "experiment": {
            "exp_name": f"fasop-{len(meshes)}-meshes",
            "exp_dir": ".",  # the launchers set the run directory
            "task": {"type": "train", "backend": "megatron", "entrypoint": ENTRYPOINT},
            "runner": {"backend": "torchrun", "nnodes": len(hosts),
                       "nproc_per_node": max(host.slots for host in hosts), "hostfile": "hostfile",
                       "rdzv_backend": "static", "master_port": opts.master_port},
            "envs": {"CUDA_DEVICE_MAX_CONNECTIONS": 1, "device_type_specific": per_label},
            **({"cmds": {"before_start": "; ".join(exports)}} if exports else {}),
        },
        "action": "run",
        "hydra": {"run": {"dir": "${experiment.exp_dir}/hydra"}},
    }


def launch_view(cluster: Any) -> Any:
    """The cluster as launchers name its nodes: a node holding several GPU kinds by its own node type (Slurm
    allocates it whole, as untyped GPUs unless its table names a GRES type), beside every other node type."""
    hosts = {name: replace(host, gres_type="" if host.gres_type is None else host.gres_type)
             for name, host in cluster.hosts.items()}
    return replace(cluster, node_types={**cluster.node_types, **hosts})


def describe(plan: Plan, model: Any, cluster: Any, meshes: Sequence[Mesh]) -> str:
    shown = ", ".join(f"{m.label} [tp {m.tp}, dp {m.dp}, pp {m.pp}, mbs {m.mbs}]" for m in meshes)
    return comment_line(f"fasop plan {plan.rank or 1}: {model.name} on {cluster.name}, FlagScale meshes {shown}, "
                        f"gbs {plan.gbs}, layers per stage {'-'.join(map(str, plan.layers_per_stage))}.")


def render_flagscale(plan: Plan, model: Any, cluster: Any, options: LaunchOptions | None = None,
                     where: str | None = None) -> dict[str, str]:
    """A stage-group plan's files for FlagScale with the Slurm launcher, name -> text, without writing anything."""
    opts = options or LaunchOptions()
    check_options(opts)
    where = where or f"plan {plan.rank or '?'}"
    model = plan_model(model, plan)
    errors = flagscale_errors(plan, model)
    if errors:
        raise InputError(where, "FlagScale cannot run it: " + "; ".join(errors))
    if opts.megatron_flavor != "stock":
        raise ArgumentError("megatron_flavor", "stage-group plans run on FlagScale (stock Megatron-LM flags)",
                            opts.megatron_flavor)
    meshes = flagscale_meshes(plan)
    hosts = flagscale_hosts(plan, cluster, meshes, where)
    nodes = flagscale_nodes(hosts)
    if opts.gpus_per_node is not None and any(slots != opts.gpus_per_node for _, slots, _ in nodes):
        raise ArgumentError("gpus_per_node", "stage-group plans use each node type's own", opts.gpus_per_node)
    train, experiment = train_config(plan, model, meshes, opts), experiment_config(meshes, hosts, opts)
    _check_words(train, "train", where)
    _check_words(experiment["experiment"]["envs"], "envs", where)
    description = describe(plan, model, cluster, meshes)
    header = [description, "# FlagScale's heterogeneous training; written by fasop emit."]
    return {
        f"{CONFIG_NAME}.yaml": yaml_text(experiment, header),
        f"train/{TRAIN_NAME}.yaml": yaml_text(train, header),
        "sbatch.sh": sbatch_text(description, nodes, model, launch_view(cluster), opts,
                                 None if opts.smoke_test else exit_duration_min(opts)),
        "plan.json": json.dumps(plan.record(), indent=2, sort_keys=True) + "\n",
    }


def flagscale_launcher_files(files: Mapping[str, str], plan: Plan, cluster: Any, out_dir: Path, options: LaunchOptions,
                             site: Mapping[str, Any]) -> dict[str, str]:
    """render_flagscale's files for `site` (as fasop.launch.launchers.launcher_files takes it): as they are for
    slurm; launch.sh and hosts for ssh; commands.txt and hostfile for manual."""
    if site["rendezvous"] != "tcp" or site["rendezvous_file"] is not None:
        raise ArgumentError("rendezvous", "FlagScale's runner meets at the first host of its hostfile",
                            site["rendezvous"])
    if site["launcher"] == "slurm":
        if site["hosts_file"] is not None:
            raise ArgumentError("hosts_file", "applies to the ssh and manual launchers", remedy="launcher")
        return dict(files)
    nodes = flagscale_nodes(flagscale_hosts(plan, cluster, flagscale_meshes(plan), f"plan {plan.rank or '?'}"))
    node_types = [node_type for node_type, _, _ in nodes]
    hosts = read_hosts(site["hosts_file"], node_types) if site["hosts_file"] else None
    description = files["sbatch.sh"].splitlines()[1]  # the plan's "# fasop plan ..." line
    kept = {name: text for name, text in files.items() if name != "sbatch.sh"}
    if site["launcher"] == "ssh":
        return {**kept, "hosts": hosts_text(plan, hosts, node_types),
                "launch.sh": launch_text(description, nodes, options)}
    return {**kept, "hostfile": hostfile_text(nodes, hosts),
            "commands.txt": commands_text(description, out_dir.absolute(), options)}
