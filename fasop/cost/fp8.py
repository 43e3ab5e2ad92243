"""FP8 training as Megatron-LM runs it through Transformer Engine (TE): which GPUs run which scaling recipe, and
what FP8 changes besides the rate of its GEMMs (docs/cost-model.md section 12).

The GEMMs of the linear layers (QKV, attention output, FFN in and out; forward, input gradient and weight
gradient) run in FP8: E4M3 inputs and weights, E5M2 gradients (Megatron-LM's `--fp8-format hybrid`). The
attention core, softmax, norms, activation functions, the embedding, the output layer (Megatron-LM's
ColumnParallelLinear, outside TE) and the optimizer stay in bf16.

- Casts: every FP8 GEMM input is quantized by a memory-bound kernel that reads it in bf16 and writes it in FP8
  twice (row-wise for this GEMM, column-wise for the one that uses it transposed: Hopper's FP8 GEMMs take only
  the TN layout). Current per-tensor scaling (`tensorwise`) reads the tensor once more for its amax first; the
  delayed recipe takes the amax from its history, block scalings compute theirs inside the cast.
- Weights are cast once per step: TE caches their FP8 copies over the micro-batches of a step
  (`is_first_microbatch`, transformer_engine/pytorch/module/linear.py), and keeps them in memory.
- Saved activations: TE keeps the column-wise FP8 copy of each GEMM input for the weight gradient, one byte an
  element instead of two, and drops the row-wise one (linear.py, "Discard row-wise data since it is not needed in
  backward pass").
- `--fp8-param-gather` (fp8_param in megatron-core) keeps the parameters themselves in FP8: the distributed
  optimizer all-gathers one byte a weight, and no bf16 copy is held beside the FP8 one.

Sources: NVIDIA/TransformerEngine @ d0067d0da (transformer_engine/pytorch/quantization.py and module/linear.py),
NVIDIA/Megatron-LM @ d98e8a64dd (megatron/training/arguments.py, megatron/core/transformer/transformer_config.py).
"""

from __future__ import annotations

from fasop.errors import ArgumentError
from fasop.inputs.catalogue import GpuSpec
from fasop.inputs.model import Model

FP8_BYTES = 1
CAST_WRITTEN_BYTES = 2 * FP8_BYTES  # the row-wise and the column-wise FP8 copy of each cast tensor

# Transformer Engine's rules (quantization.py: _compute_fp8_support, _compute_fp8_block_scaling_support,
# _compute_mxfp8_support): the lowest compute capability of each recipe, and the one from which it stops
_RECIPE_CAPABILITY = {"delayed": ((8, 9), None), "tensorwise": ((8, 9), None), "blockwise": ((9, 0), None),
                      "mxfp8": ((10, 0), (12, 0))}


def _capability(spec: GpuSpec) -> tuple[int, int]:
    major, minor = (spec.compute_capability or "0.0").split(".")
    return int(major), int(minor)


def recipe_error(spec: GpuSpec, recipe: str) -> str | None:
    """Why GPU `spec` cannot train with FP8 `recipe` (Transformer Engine's rules), or None when it can."""
    if spec.dense_fp8_tflops <= 0:
        return f"GPU {spec.name} has no FP8 tensor cores ({spec.file}: dense_fp8_tflops = 0)"
    lowest, stop = _RECIPE_CAPABILITY[recipe]
    capability = _capability(spec)
    if capability < lowest or (stop is not None and capability >= stop):
        needed = f"{lowest[0]}.{lowest[1]}" + (f" to below {stop[0]}.{stop[1]}" if stop else " or higher")
        return (f"GPU {spec.name} (compute capability {spec.compute_capability}) cannot run FP8 recipe {recipe}: "
                f"Transformer Engine needs compute capability {needed}")
    return None


def cast_bytes_per_element(model: Model) -> float:
    """Bytes one FP8 cast moves per element of the tensor it quantizes: its bf16 reads (twice for tensorwise
    scaling, whose amax comes first) and its two FP8 copies."""
    reads = 2 if model.fp8_recipe == "tensorwise" else 1
    return reads * model.precision_bytes + CAST_WRITTEN_BYTES


def weight_cast_bytes(model: Model) -> float:
    """Bytes per linear-layer weight the once-a-step FP8 casts move: the bf16 weight read and both FP8 copies
    written; with --fp8-param-gather the weight is already FP8 and only its column-wise copy is made."""
    if not model.fp8:
        return 0.0
    return 2 * FP8_BYTES if model.fp8_param_gather else cast_bytes_per_element(model)


def weight_memory_bytes(model: Model) -> float:
    """Bytes per linear-layer weight held beyond its bf16 copy: the cached FP8 copies (two bytes), or with
    --fp8-param-gather none (the FP8 parameter and its column-wise copy take the bf16 copy's two bytes)."""
    return 0.0 if not model.fp8 or model.fp8_param_gather else float(CAST_WRITTEN_BYTES)


def gemm_input_bytes(model: Model) -> int:
    """Bytes per element of a linear layer's input saved for its backward: FP8's column-wise copy, else bf16."""
    return FP8_BYTES if model.fp8 else model.precision_bytes


def gathered_param_bytes(model: Model) -> int:
    """Bytes per linear-layer weight the distributed optimizer all-gathers."""
    return FP8_BYTES if model.fp8 and model.fp8_param_gather else model.precision_bytes


def check_param_gather(model: Model, distributed_optimizer: bool) -> None:
    """--fp8-param-gather all-gathers the FP8 parameters from the distributed optimizer's shards; Megatron-LM
    refuses it without one (megatron/training/arguments.py)."""
    if model.fp8_param_gather and not distributed_optimizer:
        raise ArgumentError("fp8_param_gather", "needs the distributed optimizer (Megatron-LM all-gathers the FP8 "
                                                "parameters from its shards)")


def plan_fields(model: Model) -> dict[str, str | bool]:
    """The plan-file fields of an fp8 model's plans (none for other precisions: their plans stay as they were)."""
    if not model.fp8:
        return {}
    return {"precision": "fp8", "fp8_recipe": model.fp8_recipe, "fp8_param_gather": model.fp8_param_gather}
