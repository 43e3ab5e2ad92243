"""The specification of a 3D plan: its shape (degrees, batch sizes, placement, partition, schedule and memory
options), built and checked against its model and cluster in one place, whether it comes from a plan file, the
Python API or the command line. The estimate costs it (fasop.search.estimate), the launchers render it
(fasop.launch), calibration re-estimates it; options that follow from others are derived here once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from fasop.cost.config import (
    DEFAULT_RECOMPUTE_MODULES,
    Config,
    checked_recompute,
    fewest_layers,
    param_gather_overlaps,
    sequence_parallel_on,
    virtual_stages_error,
)
from fasop.cost.tpoverlap import overlap_error
from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.plans import Plan
from fasop.search.record import virtual_layout
from fasop.search.space import check_global_batch, context_error

Refuse = Callable[[str, str], InputError]  # (field, problem) -> the error naming it
# The Plan fields a specification is made of, named as plan_spec takes them.
SHAPE_FIELDS = ("tp", "dp", "pp", "mbs", "gbs", "placement", "layers_per_stage", "encoder_stages",
                "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "virtual_stages",
                "layers_per_virtual_stage", "recompute", "recompute_method", "recompute_num_layers", "recompute_modules",
                "sequence_parallel", "tp_comm_overlap", "cp", "ep", "etp")


@dataclass(frozen=True)
class PlanSpec:
    """A checked 3D plan: every field as Megatron-LM runs it (defaults resolved, derived options derived)."""

    tp: int
    dp: int
    pp: int
    mbs: int
    gbs: int
    placement: tuple[str, ...]  # node types in node-rank order
    layers_per_stage: tuple[int, ...]
    gpus_per_node: int
    encoder_stages: int  # encoder-decoder models: stages holding the encoder; else 0
    distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    virtual_stages: int
    layers_per_virtual_stage: tuple[int, ...]  # chunk-major, when virtual_stages > 1; else empty
    recompute: str
    recompute_method: str | None
    recompute_num_layers: int | None
    sequence_parallel: bool
    tp_comm_overlap: bool = False
    cp: int = 1
    ep: int = 1
    etp: int = 0  # an MoE model's expert-tensor-parallel degree (0: tp; a dense model's is its tp)
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES  # selective recomputation's, in canonical order

    @property
    def num_microbatches(self) -> int:
        return self.gbs // (self.dp * self.mbs)

    @property
    def config(self) -> Config:
        """What the cost model takes of the plan before its partition."""
        return Config(self.tp, self.dp, self.pp, self.mbs, self.gbs, self.encoder_stages, self.distributed_optimizer,
                      overlap_grad_reduce=self.overlap_grad_reduce, overlap_param_gather=self.overlap_param_gather,
                      virtual_stages=self.virtual_stages, recompute=self.recompute,
                      recompute_method=self.recompute_method, recompute_num_layers=self.recompute_num_layers,
                      sequence_parallel=self.sequence_parallel, tp_comm_overlap=self.tp_comm_overlap, cp=self.cp,
                      ep=self.ep, etp=self.etp, recompute_modules=self.recompute_modules)


def plan_spec(model: Model, cluster: Cluster, *, tp: int, dp: int, pp: int, mbs: int, placement: Sequence[str],
              layers_per_stage: Sequence[int], gbs: int | None = None, encoder_stages: int | None = None,
              distributed_optimizer: bool = True, overlap_grad_reduce: bool = True,
              overlap_param_gather: bool | None = None, virtual_stages: int = 1,
              layers_per_virtual_stage: Sequence[int] | None = None, recompute: str = "none",
              recompute_method: str | None = None, recompute_num_layers: int | None = None,
              recompute_modules: Sequence[str] | None = None,
              sequence_parallel: bool | None = None, tp_comm_overlap: bool = False,
              cp: int = 1, ep: int = 1, etp: int | None = None, gpus_per_node: int | None = None,
              where: str | None = None) -> PlanSpec:
    """The plan checked against `model` and `cluster`. Arguments are named as plan files name their fields;
    None: fasop's default (the model's global batch, the encoder stages the layers imply, parameters gathered
    during the forward when the optimizer is distributed and gradients reduced during the backward, sequence
    parallelism when tp > 1, each stage's layers split evenly over its chunks; tensor-parallel communication
    overlap off); full recomputation without a method is uniform over every layer, selective recomputation
    without modules reruns the attention core. `gpus_per_node`: the launch's own, instead of the placement's node
    types'.
    Errors name the argument, or `where` and the field (a plan file's)."""
    def refuse(field: str, problem: str) -> InputError:
        return ArgumentError(field, problem) if where is None else InputError(f"{where}: {field}", problem)

    placement, layers = tuple(placement), tuple(layers_per_stage)
    _check_nodes(cluster, placement, refuse)
    sizes = sorted({cluster.node_types[name].gpus_per_node for name in placement})
    if len(sizes) > 1:
        raise refuse("placement", f"its node types hold {' and '.join(map(str, sizes))} GPUs per node: a plan of one "
                                  "tp and dp gives every node as many ranks (stage-group plans mix node sizes)")
    gpn = (sizes[0] if sizes else cluster.gpus_per_node) if gpus_per_node is None else gpus_per_node
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:  # written into launch scripts as it is
        raise InputError(f"cluster {cluster.name}: gpus_per_node", f"expected an integer >= 1, got {gpn!r}")
    gbs = check_global_batch(model.global_batch_size if gbs is None else gbs)
    if gpn % tp or model.num_attention_heads % tp or model.num_query_groups % tp:
        raise refuse("tp", f"expected a divisor of the {gpn} GPUs per node, of the {model.num_attention_heads} "
                           f"attention heads and of the {model.num_query_groups} query groups, got {tp}")
    etp = _check_context_and_experts(model, tp, dp, cp, ep, etp, sequence_parallel, refuse)
    if tp * cp * dp * pp != len(placement) * gpn:
        raise refuse("placement", f"tp x cp x dp x pp = {tp * cp * dp * pp} GPUs, but the placement's "
                                  f"{len(placement)} nodes of {gpn} GPUs hold {len(placement) * gpn}")
    if gbs % (dp * mbs):
        raise refuse("mbs", f"dp x mbs = {dp * mbs} must divide the global batch size {gbs}")
    if len(layers) != pp or sum(layers) != model.num_layers:
        raise refuse("layers_per_stage", f"expected {pp} stage counts summing to {model.num_layers} layers, "
                                         f"got {','.join(map(str, layers))}")
    if not 1 <= virtual_stages <= model.num_layers:  # before anything is built per model chunk
        raise refuse("virtual_stages", f"expected 1 to the model's {model.num_layers} layers (each model chunk of the "
                                       f"interleaved schedule holds layers), got {virtual_stages}")
    encoder = _encoder_stages(model, layers, refuse)
    if encoder_stages is not None and encoder_stages != encoder:
        raise refuse("encoder_stages", f"expected {encoder}, the stages holding the model's "
                                       f"{model.encoder_num_layers} encoder layers, got {encoder_stages}")
    recompute_method, recompute_num_layers, modules = checked_recompute(
        model, recompute, recompute_method, recompute_num_layers, recompute_modules, refuse)
    _check_tensor_parallel(model, cluster, placement, tp, sequence_parallel, tp_comm_overlap, refuse, cp)
    spec = PlanSpec(tp=tp, dp=dp, pp=pp, mbs=mbs, gbs=gbs, placement=placement, layers_per_stage=layers,
                    gpus_per_node=gpn, encoder_stages=encoder, distributed_optimizer=distributed_optimizer,
                    overlap_grad_reduce=overlap_grad_reduce,
                    overlap_param_gather=param_gather_overlaps(overlap_grad_reduce, distributed_optimizer,
                                                               overlap_param_gather),
                    virtual_stages=virtual_stages, layers_per_virtual_stage=(), recompute=recompute,
                    recompute_method=recompute_method, recompute_num_layers=recompute_num_layers,
                    sequence_parallel=sequence_parallel_on(tp, sequence_parallel), tp_comm_overlap=tp_comm_overlap,
                    cp=cp, ep=ep, etp=etp, recompute_modules=modules)
    if pp > 1 and (np.array(layers) < fewest_layers(model, spec.config)).any():
        raise refuse("layers_per_stage", f"every stage needs at least the {spec.config.blocked_layers} layers "
                                         "block recomputation reruns in it" if spec.config.blocked_layers else
                     "every stage needs at least one layer (the first may hold only the embedding, the last only "
                     "the head)")
    chunks = _virtual_layout(model, spec, layers_per_virtual_stage, refuse)
    return replace(spec, layers_per_virtual_stage=tuple(chunks)) if chunks else spec


def spec_of(plan: Plan, model: Model, cluster: Cluster, where: str | None = None,
            gpus_per_node: int | None = None) -> PlanSpec:
    """The specification of a 3D plan record (a plan file's, its fields checked by the plan schema, or a
    search's): the shape fields it states; a field left out or null takes fasop's default."""
    fields = {name: value for name in SHAPE_FIELDS if name in plan.model_fields_set
              and (value := getattr(plan, name)) is not None}
    return plan_spec(model, cluster, **fields, gpus_per_node=gpus_per_node, where=where)


def _check_nodes(cluster: Cluster, placement: tuple[str, ...], refuse: Refuse) -> None:
    """Every node type the placement names is the cluster's, in no more nodes than it has."""
    for name in dict.fromkeys(placement):
        if name not in cluster.node_types:
            raise refuse("placement", f"node type {name} is not in cluster {cluster.name} (it has "
                                      f"{', '.join(cluster.node_types)})")
        used, have = placement.count(name), cluster.node_types[name].count
        if used > have:
            raise refuse("placement", f"uses {used} nodes of type {name}, cluster {cluster.name} has {have}")


def _check_tensor_parallel(model: Model, cluster: Cluster, placement: tuple[str, ...], tp: int,
                           sequence_parallel: bool | None, tp_comm_overlap: bool, refuse: Refuse, cp: int = 1) -> None:
    """Sequence parallelism needs tp > 1, as Megatron-LM does; --tp-comm-overlap runs where Megatron-LM and the
    userbuffers allow it (fasop.cost.tpoverlap.overlap_error)."""
    if sequence_parallel and tp == 1:
        raise refuse("sequence_parallel", "needs tensor parallelism (tp > 1), as Megatron-LM does")
    if tp_comm_overlap:
        gpus = tuple(sorted({cluster.node_types[name].gpu for name in placement}))
        problem = overlap_error(model, tp, sequence_parallel_on(tp, sequence_parallel), gpus, cp)
        if problem:
            raise refuse("tp_comm_overlap", problem)


def _check_context_and_experts(model: Model, tp: int, dp: int, cp: int, ep: int, etp: int | None,
                               sequence_parallel: bool | None, refuse: Refuse) -> int:
    """Megatron-LM's rules for context and expert parallelism (round 3 reference, part A sections 2 and 3);
    the expert-tensor-parallel degree, by default tp (1 for experts with biases; a dense model's is its tp)."""
    problem = context_error(model, cp)
    if problem:
        raise refuse("cp", problem)
    if not model.is_moe:
        for name, value in (("ep", ep), ("etp", etp)):
            if value not in (None, 1) and not (name == "etp" and value == tp):
                raise refuse(name, f"expert parallelism needs an MoE model (num_experts); {model.name} is dense")
        return tp
    etp = (1 if model.linear_bias else tp) if etp is None else etp
    if model.linear_bias and etp != 1:
        raise refuse("etp", f"experts with linear biases need etp 1, as megatron-core asserts; got {etp}")
    if model.num_experts % ep:
        raise refuse("ep", f"expected a divisor of the {model.num_experts} experts, got {ep}")
    if (tp * cp * dp) % (etp * ep):
        raise refuse("etp", f"etp x ep = {etp * ep} must divide tp x cp x dp = {tp * cp * dp} (Megatron-LM folds the "
                            "expert grid out of the dense one)")
    if tp > 1 and not sequence_parallel_on(tp, sequence_parallel):
        raise refuse("sequence_parallel", "MoE layers with tp > 1 need sequence parallelism, as Megatron-LM does")
    return etp


def _encoder_stages(model: Model, layers: tuple[int, ...], refuse: Refuse) -> int:
    """The stages holding an encoder-decoder model's encoder layers (0: no encoder split)."""
    if not model.is_encoder_decoder or len(layers) == 1:
        return 0
    prefix = np.cumsum(layers)
    if model.encoder_num_layers not in prefix[:-1]:
        raise refuse("layers_per_stage", f"no stage boundary falls after the {model.encoder_num_layers} encoder layers")
    return int(np.searchsorted(prefix, model.encoder_num_layers)) + 1


def _virtual_layout(model: Model, spec: PlanSpec, given: Sequence[int] | None, refuse: Refuse) -> list[int]:
    """Layers per virtual stage: each stage's split evenly over its chunks (what Megatron-LM runs and fasop
    estimates); a plan file's own layout must be that one."""
    v = spec.virtual_stages
    if given is not None and v == 1:
        raise refuse("layers_per_virtual_stage", "given, but virtual_stages is 1 or missing")
    if v == 1:
        return []
    refusal = virtual_stages_error(model, spec.pp, v, spec.num_microbatches)
    if refusal is not None:
        raise refuse("virtual_stages", f"{v}: {refusal}")
    even = virtual_layout(np.array(spec.layers_per_stage), v)
    if given is not None and list(given) != even:
        raise refuse("layers_per_virtual_stage",
                     f"expected {even}: each stage's layers split evenly over its {v} chunks, the first chunks "
                     f"taking one more, in virtual-stage order; got {list(given)}")
    return even

