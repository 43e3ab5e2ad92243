"""Megatron-LM flags of a plan: parallelism, activation recomputation, how its layers are split over the
pipeline stages, the model's shape and attention backend, training and data.

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

from collections.abc import Sequence
from typing import Any

from fasop.cost.config import DEFAULT_RECOMPUTE_MODULES
from fasop.errors import ArgumentError, InputError
from fasop.inputs.training import training_settings
from fasop.launch.options import LaunchOptions
from fasop.launch.resume import save_interval, train_iters
from fasop.search.spec import PlanSpec

ENTRY_SCRIPTS = {"decoder": "pretrain_gpt.py", "encoder": "pretrain_bert.py", "encoder-decoder": "pretrain_t5.py"}


_WORDPIECE = ("BertWordPieceLowerCase", "BertWordPieceCase")


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
    if share is not None and (share < 1 or any(n != share for n in middle)):
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


def _interleaved_flags(p: PlanSpec, opts: LaunchOptions) -> list[tuple[str, ...]]:
    """An interleaved plan's layers: `--num-virtual-stages-per-pipeline-rank` when every virtual stage holds the
    same layers, else the layout with one entry per virtual stage (which implies the virtual size); never both."""
    if opts.megatron_flavor == "fasop-fork":
        raise ArgumentError("megatron_flavor", "runs no interleaved pipeline; emit this plan for stock Megatron-LM",
                            "fasop-fork")
    chunks = list(p.layers_per_virtual_stage)
    if len(set(chunks)) == 1 and opts.pipeline_split != "layout":
        return [("--num-virtual-stages-per-pipeline-rank", str(p.virtual_stages))]
    return [("--pipeline-model-parallel-layout", pipeline_layout(chunks))]


def _encoder_decoder_flags(p: PlanSpec, opts: LaunchOptions, where: str) -> list[tuple[str, ...]]:
    """Stock Megatron-LM's split of an encoder-decoder model: the encoder stages, each side split evenly."""
    if opts.pipeline_split != "auto":
        raise ArgumentError("pipeline_split", "applies to decoder and encoder models only; encoder-decoder plans "
                            "use Megatron-LM's --pipeline-model-parallel-split-rank", opts.pipeline_split)
    layers = list(p.layers_per_stage)
    encoder, decoder = layers[:p.encoder_stages], layers[p.encoder_stages:]
    if len(set(encoder)) > 1 or len(set(decoder)) > 1:
        raise InputError(f"{where}: layers_per_stage",
                         f"encoder-decoder split {layers} (encoder stages {encoder}, decoder stages {decoder}) cannot be "
                         "run by stock Megatron-LM: --pipeline-model-parallel-split-rank splits the encoder's layers "
                         "evenly over the encoder stages and the decoder's over the rest, and the pipeline layout "
                         "has no encoder layers; use an even split or --megatron-flavor fasop-fork")
    return [("--pipeline-model-parallel-split-rank", str(p.encoder_stages))]


def split_layer_flags(p: PlanSpec, model: Any, opts: LaunchOptions, where: str) -> list[tuple[str, ...]]:
    """The flags that tell Megatron-LM how many layers each pipeline stage holds."""
    if p.pp == 1:
        return []
    layers = list(p.layers_per_stage)
    if p.virtual_stages > 1:
        return _interleaved_flags(p, opts)
    if opts.megatron_flavor == "fasop-fork":
        flags: list[tuple[str, ...]] = [("--balance", "-".join(str(n) for n in layers))]
        if model.architecture == "encoder-decoder":
            flags.append(("--pipeline-model-parallel-split-rank", str(p.encoder_stages)))
        return flags
    if model.architecture == "encoder-decoder":
        return _encoder_decoder_flags(p, opts, where)
    if opts.pipeline_split == "layout":
        return [("--pipeline-model-parallel-layout", pipeline_layout(layers))]
    if len(set(layers)) == 1:
        return []
    first_last = first_last_split(layers)
    if first_last is not None:
        flags = []  # of the same type as the fork's flags above
        if first_last[0] is not None:
            flags.append(("--decoder-first-pipeline-num-layers", str(first_last[0])))
        if first_last[1] is not None:
            flags.append(("--decoder-last-pipeline-num-layers", str(first_last[1])))
        return flags
    if opts.pipeline_split == "first-last":
        raise ArgumentError("pipeline_split", f"split {layers} does not have that form (equal middle stages, "
                            "first/last stages of >= 1 layer); use the layout split", "first-last")
    return [("--pipeline-model-parallel-layout", pipeline_layout(layers))]


def tensor_parallel_flags(p: PlanSpec) -> list[tuple[str, ...]]:
    """`--sequence-parallel`, and `--tp-comm-overlap` (Transformer Engine's userbuffers; Megatron-LM's defaults for
    which collectives overlap, as fasop.cost.tpoverlap models them) when the plan runs them."""
    return [flag for flag, on in ((("--sequence-parallel",), p.sequence_parallel),
                                  (("--tp-comm-overlap",), p.tp_comm_overlap)) if on]


def context_expert_flags(p: PlanSpec, model: Any) -> list[tuple[str, ...]]:
    """`--context-parallel-size` above 1, and an MoE model's expert-parallel and expert-tensor-parallel sizes."""
    flags: list[tuple[str, ...]] = [("--context-parallel-size", str(p.cp))] if p.cp > 1 else []
    if getattr(model, "is_moe", False):
        flags += [("--expert-model-parallel-size", str(p.ep)), ("--expert-tensor-parallel-size", str(p.etp))]
    return flags


def moe_layer_freq(freq: int | tuple[int, ...]) -> str:
    """Megatron-LM's --moe-layer-freq: the integer, or the per-layer list as the run-length expression its
    parser evaluates (no spaces: [0]*3+[1]*58)."""
    if isinstance(freq, int):
        return str(freq)
    runs: list[list[int]] = []
    for value in freq:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return "+".join(f"[{value}]*{count}" for value, count in runs)


def _moe_flags(model: Any) -> list[tuple[str, ...]]:
    """An MoE model's experts as Megatron-core runs them here and fasop prices them: the alltoall token dispatcher
    and grouped GEMM (fasop.cost.roofline); top-1 softmax routing with Megatron-LM's required pre-softmax."""
    if not getattr(model, "is_moe", False):
        return []
    if model.architecture != "decoder":
        raise InputError(f"{model.file}: model.architecture", f"{model.architecture} MoE models: stock Megatron-LM has "
                                                              "MoE layers only in GPT-style decoders (fasop plans them, "
                                                              "but emits no launch for them)")
    flags: list[tuple[str, ...]] = [("--num-experts", str(model.num_experts)),
                                    ("--moe-router-topk", str(model.moe_router_topk)),
                                    ("--moe-ffn-hidden-size", str(model.expert_ffn_hidden_size)),
                                    ("--moe-layer-freq", moe_layer_freq(model.moe_layer_freq)),
                                    ("--moe-token-dispatcher-type", "alltoall"), ("--moe-grouped-gemm",)]
    if model.moe_shared_expert_intermediate_size:
        flags.append(("--moe-shared-expert-intermediate-size", str(model.moe_shared_expert_intermediate_size)))
    if model.moe_capacity_factor is not None:
        flags.append(("--moe-expert-capacity-factor", f"{model.moe_capacity_factor:g}"))
    if model.moe_router_topk == 1:
        flags.append(("--moe-router-pre-softmax",))
    return flags


def _latent_attention_flags(model: Any) -> list[tuple[str, ...]]:
    """Multi-latent attention with every rank and head dimension given (--kv-lora-rank's default, 32, is not the
    models')."""
    if not getattr(model, "multi_latent_attention", False):
        return []
    flags: list[tuple[str, ...]] = [("--multi-latent-attention",)]
    if model.q_lora_rank:
        flags.append(("--q-lora-rank", str(model.q_lora_rank)))
    return flags + [("--" + name.replace("_", "-"), str(getattr(model, name)))
                    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")]


def recompute_flags(p: PlanSpec) -> list[tuple[str, ...]]:
    """Activation recomputation: `--recompute-granularity`, for full recomputation its method and layers, for
    selective its modules where they are not Megatron-LM's default."""
    if p.recompute == "none":
        return []
    flags: list[tuple[str, ...]] = [("--recompute-granularity", p.recompute)]
    if p.recompute == "full":
        flags += [("--recompute-method", str(p.recompute_method)), ("--recompute-num-layers", str(p.recompute_num_layers))]
    elif p.recompute_modules != DEFAULT_RECOMPUTE_MODULES:
        flags.append(("--recompute-modules", *p.recompute_modules))
    return flags


def _optimizer_flags(model: Any) -> list[tuple[str, ...]]:
    """Megatron-LM's precision-aware optimizer and the dtypes of Adam's state the memory model assumed."""
    if not getattr(model, "use_precision_aware_optimizer", False):
        return []
    if model.main_params_dtype == "none":
        raise InputError(f"{model.file}: model.main_params_dtype", "\"none\" (no master weights) is NeMo's "
                                                                  "distributed Adam; Megatron-LM keeps fp32 or fp16 ones")
    flags: list[tuple[str, ...]] = [("--use-precision-aware-optimizer",)]
    for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(model, name) != "fp32":
            flags.append(("--" + name.replace("_", "-"), getattr(model, name)))
    return flags


def _newer_model_flags(model: Any) -> list[tuple[str, ...]]:
    """The model's flags that Megatron-LM gained after the FASOP fork was made."""
    newer: list[tuple[str, ...]] = []
    newer += _moe_flags(model) + _latent_attention_flags(model)
    if model.num_query_groups != model.num_attention_heads:
        newer.append(("--group-query-attention",))
        newer.append(("--num-query-groups", str(model.num_query_groups)))
    if model.ffn_activation == "swiglu":
        newer.append(("--swiglu",))
    elif model.ffn_activation == "squared-relu":
        newer.append(("--squared-relu",))
    if model.grad_reduce_in_bf16:
        newer.append(("--grad-reduce-in-bf16",))
    newer += _optimizer_flags(model)
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
    # the attention kernel the memory model assumed (an AttnBackend name of megatron-core; its default, auto, may
    # pick a fused kernel that keeps no attention scores); the FASOP fork runs unfused attention and has no flag
    if getattr(model, "flash_attention", False):
        newer.append(("--attention-backend", "flash"))
    return newer


def model_flags(model: Any, opts: LaunchOptions) -> list[tuple[str, ...]]:
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
    newer = _newer_model_flags(model)
    if newer and opts.megatron_flavor == "fasop-fork":
        names = ", ".join(f[0] for f in newer)
        raise ArgumentError("megatron_flavor", f"model {model.name} needs {names}, which the FASOP fork (Megatron-LM "
                                               "of early 2023) lacks; use stock", "fasop-fork")
    flags += newer
    if opts.megatron_flavor != "fasop-fork" and not getattr(model, "flash_attention", False):
        flags.append(("--attention-backend", "unfused"))
    divisible = getattr(model, "make_vocab_size_divisible_by", 128)
    if divisible != 128:
        flags.append(("--make-vocab-size-divisible-by", str(divisible)))
    if not model.dropout:
        flags += [("--attention-dropout", "0"), ("--hidden-dropout", "0")]
    if model.high_precision in ("fp16", "bf16"):
        flags.append((f"--{model.high_precision}",))
    if model.fp8:  # Transformer Engine's FP8 GEMMs: E4M3 forward, E5M2 gradients (fasop.cost.fp8)
        if opts.megatron_flavor == "fasop-fork":
            raise ArgumentError("megatron_flavor", "an fp8 plan needs --fp8-recipe, which the FASOP fork (Megatron-LM "
                                                   "of early 2023) lacks; use stock", "fasop-fork")
        flags += [("--fp8-format", "hybrid"), ("--fp8-recipe", model.fp8_recipe)]
        if model.fp8_param_gather:
            flags.append(("--fp8-param-gather",))
    return flags


SMOKE_TEST_LR = "1.0e-4"  # any rate will do for a smoke test of a model file that gives none


def training_flags(plan: Any, model: Any, opts: LaunchOptions) -> list[tuple[str, ...]]:
    """The run's length, the model's [training] hyperparameters (fasop.inputs.training) and, for a full run,
    checkpoints and the stop on SIGTERM. The stop before a job's time limit, `--exit-duration-in-mins`, is
    added at run time where sbatch.sh sets it (fasop.launch.resume): other launchers have no time limit."""
    iters = train_iters(plan, opts)
    settings = training_settings(model, opts.training).model_dump(exclude_none=True)
    settings.pop("source", None)
    if "lr" not in settings:
        if not opts.smoke_test:
            raise ArgumentError("training", f"model {model.name} gives no lr in its [training] table, and a full run "
                                            "needs one (Megatron-LM has no default); add it or give lr=VALUE")
        settings["lr"] = SMOKE_TEST_LR
    flags: list[tuple[str, ...]] = [("--train-iters", str(iters)), ("--lr-decay-iters", str(iters))]
    flags += [("--" + key.replace("_", "-"), str(value)) for key, value in settings.items()]
    flags += [("--log-interval", "10"), ("--eval-iters", "0")]
    if not opts.smoke_test:
        flags += [("--save", opts.checkpoint_dir), ("--load", opts.checkpoint_dir),
                  ("--save-interval", str(save_interval(plan, opts, iters))), ("--exit-signal-handler",)]
    return flags


def data_flags(model: Any, opts: LaunchOptions) -> list[tuple[str, ...]]:
    fork = opts.megatron_flavor == "fasop-fork"
    if fork and (opts.data_path is None or (opts.vocab_file is None and opts.tokenizer_model is None)):
        raise ArgumentError("megatron_flavor", "needs a data path and a vocabulary file (that Megatron-LM has no mock "
                                               "data and no null tokenizer)", "fasop-fork")
    no_tokenizer = opts.tokenizer_type is None and opts.vocab_file is None and opts.tokenizer_model is None
    if not opts.smoke_test and (opts.data_path is None or no_tokenizer):
        missing = [what for what, absent in (("data_path", opts.data_path is None), (
            "a tokenizer (tokenizer_type, tokenizer_model or vocab_file)", no_tokenizer)) if absent]
        raise ArgumentError("data_path" if opts.data_path is None else "tokenizer_type",
                            f"a full run needs {' and '.join(missing)}; mock data is for a smoke_test only")
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
