"""The plan record: one plan of a search or an estimate with every term of its step time, memory and price,
as plan files hold it (docs/formats.md)."""

from __future__ import annotations

import numpy as np

from fasop.cost.communication import Geometry
from fasop.cost.config import Config, chunk_layers, recompute_modules_field
from fasop.cost.fp8 import plan_fields
from fasop.cost.price import cost_per_step_usd, price_per_hour_usd
from fasop.cost.step import StageCosts, breakdown
from fasop.inputs.model import Model
from fasop.inputs.profiles import profile_sources
from fasop.search.space import Inputs


def degree_fields(model: Model, config: Config) -> dict[str, int]:
    """The plan fields of context and expert parallelism: cp where it is above 1, ep and etp for an MoE model."""
    return {**({"cp": config.cp} if config.cp > 1 else {}),
            **({"ep": config.ep, "etp": config.expert_tp} if model.is_moe else {})}


def plan_rows(inputs: Inputs, plans: list[tuple[Config, Geometry, bool]], costs: StageCosts, counts: np.ndarray,
              exact: dict[str, np.ndarray] | None = None) -> list[dict]:
    """One record per row k of `costs`, the plan plans[k] = (config, placement, whether its placements were searched
    exhaustively) with the layer counts counts[k]; `exact`: the exact step terms of the rows when already computed."""
    model, cluster = inputs.model, inputs.cluster
    terms = breakdown(costs, counts, exact)
    layers = (counts + costs.fixed_layers).astype(int)
    load = terms["stage_memory_gib"] / terms["stage_capacity_gib"]
    sources = profile_sources(inputs.profiles)
    rows = []
    for k, (config, geo, exhaustive) in enumerate(plans):
        price = price_per_hour_usd(cluster, geo.placement)
        worst = int(np.argmax(load[k]))
        step = float(terms["step_time_s"][k])
        mbs = int(costs.mbs[k])
        sends = [*costs.boundary_s[k].tolist(), 0.0]
        columns = zip(range(config.pp), costs.gpu[k], geo.stage_nodes, layers[k].tolist(), terms["stage_compute_s"][k].tolist(),
                      terms["stage_forward_s"][k].tolist(), terms["stage_recompute_s"][k].tolist(), sends,
                      terms["stage_p2p_s"][k].tolist(), terms["stage_allreduce_s"][k].tolist(),
                      terms["stage_memory_gib"][k].tolist(), terms["stage_capacity_gib"][k].tolist())
        stages = [
            {"stage": s, "gpu": gpu, "nodes": list(nodes), "layers": n, "compute_s": compute, "forward_s": forward,
             "recompute_s": recompute, "send_s": send, "p2p_s": p2p, "dp_allreduce_s": allreduce, "memory_gib": memory,
             "memory_capacity_gib": capacity}
            for s, gpu, nodes, n, compute, forward, recompute, send, p2p, allreduce, memory, capacity in columns
        ]
        interleaved = {}
        if config.virtual_stages > 1:
            for stage, chunks in zip(stages, chunk_times(costs, counts, int(k), config.virtual_stages)):
                stage["chunks"] = chunks
            interleaved = {"wrap_send_s": float(costs.schedule.wrap_s[k])}
        recompute = {"recompute": config.recompute, "recompute_method": config.recompute_method,
                     "recompute_num_layers": config.recompute_num_layers,
                     "recompute_modules": recompute_modules_field(config)}
        rows.append({
            "model": model.name, "model_file": model.file,
            **({"seq_length": model.seq_length} if model.seq_length_changed else {}),
            "cluster": cluster.name, "cluster_file": cluster.file,
            **sources, "kind": "3d",
            "gbs": config.gbs, "mbs": mbs, "tp": config.tp, "dp": config.dp, "pp": config.pp,
            **degree_fields(model, config),
            "num_microbatches": config.gbs // (config.dp * mbs),
            "placement": list(geo.placement), "layers_per_stage": layers[k].tolist(),
            "encoder_stages": config.encoder_stages, "distributed_optimizer": config.distributed_optimizer,
            "overlap_grad_reduce": config.overlap_grad_reduce, "overlap_param_gather": config.overlap_param_gather,
            "virtual_stages": config.virtual_stages,
            **({"layers_per_virtual_stage": virtual_layout(layers[k], config.virtual_stages)}
               if config.virtual_stages > 1 else {}),
            "timing": "exact-schedule",
            **{key: value for key, value in recompute.items() if value is not None},
            "sequence_parallel": config.sequence_parallel,
            **({"tp_comm_overlap": True} if config.tp_comm_overlap else {}),  # left out when off
            **plan_fields(model),
            "step_time_s": step,
            "throughput_samples_per_s": config.gbs / step,
            "tokens_per_s": config.gbs * model.seq_length / step,
            "pipeline_time_s": float(terms["pipeline_time_s"][k]), "bubble_s": float(terms["bubble_s"][k]),
            "p2p_s": float(terms["p2p_s"][k]), "dp_allreduce_s": float(terms["dp_allreduce_s"][k]),
            "embedding_allreduce_s": float(terms["embedding_allreduce_s"][k]),
            "dp_exposed_s": float(terms["dp_exposed_s"][k]), "optimizer_s": float(terms["optimizer_s"][k]),
            "closed_form_step_s": float(terms["closed_form_step_s"][k]), **interleaved,
            "recompute_s": float(terms["recompute_s"][k]),
            "peak_memory_gib": float(terms["stage_memory_gib"][k, worst]),
            "memory_capacity_gib": float(terms["stage_capacity_gib"][k, worst]),
            "cost_per_hour_usd": price, "cost_per_step_usd": cost_per_step_usd(price, step),
            "placement_search": "exhaustive" if exhaustive else "type-blocks",
            "stages": stages,
        })
    return rows


def chunk_times(costs: StageCosts, counts: np.ndarray, k: int, v: int) -> list[list[dict]]:
    """Each stage's model chunks of row k: forward, recomputed forward and backward of one micro-batch, as the
    exact schedule times them (fasop.cost.exact.ScheduleBatch.chunks and recompute_s)."""
    row = np.array([k])
    forward, backward = costs.schedule.chunks(row, v, counts[row])
    recompute = costs.schedule.recompute_s(row, v, counts[row])
    return [[{"forward_s": float(f), "recompute_s": float(r), "backward_s": float(b)}
             for f, r, b in zip(fs, rs, bs)] for fs, rs, bs in zip(forward[0], recompute[0], backward[0])]


def virtual_layout(layers: np.ndarray, virtual_stages: int) -> list[int]:
    """Layers of each virtual stage in Megatron's order (chunk c of stage i is virtual stage c * pp + i)."""
    return chunk_layers(layers, virtual_stages).T.ravel().astype(int).tolist()
