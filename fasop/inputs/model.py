"""The model description: shape and parameter counts of one Transformer, following Megatron-LM's layer
structure. What the model occupies in memory and on the wire is the cost model's (fasop.cost.memory,
fasop.cost.communication).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from typing import Annotated, Literal

from fasop.errors import ArgumentError, InputError
from fasop.inputs import bundled
from fasop.inputs.names import Name
from fasop.inputs.tomlfile import Flag, Range, Table, Text, expected, read_toml, validated

PRECISION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8": 2}  # fp8: its tensors outside the FP8 GEMMs, in bf16
PRECISIONS = ("fp16", "bf16", "fp32", "fp8")
# Transformer Engine's FP8 scaling recipes as Megatron-LM's --fp8-recipe names them (delayed: amax history;
# tensorwise: current per-tensor scaling; blockwise: 1 x 128 and 128 x 128 blocks; mxfp8: 32-element blocks)
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
# Dtypes of Adam's state as Megatron-LM's precision-aware optimizer names them (--main-params-dtype,
# --exp-avg-dtype, --exp-avg-sq-dtype). "none": no master copy, Adam updates the weights in their own dtype
# (NeMo's distributed Adam with its state in the model's dtype; not a Megatron-LM option).
MAIN_PARAMS_DTYPES = ("fp32", "fp16", "none")
MOMENT_DTYPES = ("fp32", "fp16", "bf16", "fp8")
# Ranges of the shape fields of a model file (docs/formats.md): beyond any trained Transformer, small enough
# that parameter, activation and FLOP counts stay finite. Layers: the deepest published models have a few hundred
# (Llama 3.1 405B 126, DeepSeek-V3 61); the partition search's work grows with layers x stages.
MAX_LAYERS = 1024
MAX_WIDTH = 2**20  # hidden_size, kv_channels (ffn_hidden_size: 4x)
MAX_HEADS = 2**16
MAX_SEQ_LENGTH = 2**24
MAX_VOCAB = 2**24
MAX_EXPERTS = 2**16
MOE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
              "moe_capacity_factor", "moe_load_imbalance")
MLA_FIELDS = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")  # q_lora_rank: optional
# Fields that change an estimate and that the shape does not imply: how the model is built and trained. A model
# file that leaves one out takes the default of ModelTable, and the command line says so (docs/formats.md). The
# shape's own defaults (kv_channels, num_query_groups, ffn_hidden_size) follow from the fields given, and
# make_vocab_size_divisible_by's, grad_reduce_in_bf16's and the optimizer's dtypes are Megatron-LM's.
ASSUMED_FIELDS = ("tie_embeddings", "position_embedding", "normalization", "ffn_activation", "flash_attention",
                  "dropout", "linear_bias", "precision")


@dataclass(frozen=True)
class Model:
    name: str
    architecture: str
    encoder_num_layers: int  # transformer layers of the encoder (0 for decoder-only models)
    decoder_num_layers: int  # transformer layers of the decoder (0 for encoder-only models)
    hidden_size: int
    num_attention_heads: int
    kv_channels: int
    num_query_groups: int
    ffn_hidden_size: int
    encoder_seq_length: int
    decoder_seq_length: int
    vocab_size: int
    tie_embeddings: bool = True
    position_embedding: str = "learned"
    normalization: str = "layernorm"
    ffn_activation: str = "gelu"
    flash_attention: bool = False
    dropout: bool = True
    linear_bias: bool = True
    precision: str = "fp16"  # fp8: Transformer Engine's FP8 GEMMs in the linear layers, bf16 around them
    fp8_recipe: str = "delayed"  # fp8 only: its scaling recipe (FP8_RECIPES), Megatron-LM's default
    fp8_param_gather: bool = False  # fp8 only: parameters kept and all-gathered in FP8 (--fp8-param-gather)
    grad_reduce_in_bf16: bool = False  # bf16 only: gradients kept and reduced in bf16 (Megatron-LM --grad-reduce-in-bf16)
    # Adam's state (fasop.cost.memory.optimizer_state_bytes): Megatron-LM's --use-precision-aware-optimizer
    # (Transformer Engine's FusedAdam, which keeps fp32 master weights of bf16 ones as their 16-bit remainders)
    use_precision_aware_optimizer: bool = False
    main_params_dtype: str = "fp32"  # MAIN_PARAMS_DTYPES
    exp_avg_dtype: str = "fp32"  # MOMENT_DTYPES
    exp_avg_sq_dtype: str = "fp32"
    # Mixture-of-Experts, as Megatron-LM's arguments name it (num_experts 0: a dense model)
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0  # each routed expert's FFN width (0: ffn_hidden_size)
    moe_shared_expert_intermediate_size: int = 0  # the shared experts' FFN width, all of them together
    moe_layer_freq: int | tuple[int, ...] = 1  # as the file gives it: every k-th layer, or 0/1 per layer
    moe_capacity_factor: float | None = None  # None: dropless
    moe_load_imbalance: float = 1.0  # the busiest expert rank's routed tokens over the mean (1: in balance)
    # multi-latent attention (DeepSeek-V2/V3): the low ranks of queries (0: not compressed) and keys/values, and
    # the head dimensions of the query-key product, its rotary part and the values
    multi_latent_attention: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    global_batch_size: int = 1
    make_vocab_size_divisible_by: int = 128
    source: str = ""
    file: str = field(default="", compare=False)
    file_seq_length: int = field(default=0, compare=False)  # the sequence length the model file gives
    defaulted: tuple[str, ...] = field(default=(), compare=False)  # ASSUMED_FIELDS the model file leaves out

    def __hash__(self) -> int:  # cheap: the cached methods below hash the model on every call
        return hash((self.name, self.hidden_size, self.encoder_num_layers, self.decoder_num_layers,
                     self.encoder_seq_length, self.decoder_seq_length))

    def defaults_taken(self) -> dict[str, bool | str]:
        """The values taken for the fields the model file leaves out (`defaulted`), by field."""
        return {name: getattr(self, name) for name in self.defaulted}

    # -- shape -------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.encoder_num_layers + self.decoder_num_layers

    @property
    def seq_length(self) -> int:
        """Tokens per sample that count as training tokens (the decoder's, or the encoder's alone)."""
        return self.decoder_seq_length or self.encoder_seq_length

    def layer_seq_length(self, kind: str) -> int:
        """Tokens per sample of a transformer layer of segment `kind` (the encoder's, or the decoder's)."""
        return self.encoder_seq_length if kind == "encoder" else self.seq_length

    @property
    def seq_length_changed(self) -> bool:
        """Whether the sequence length is not the model file's (--seq-length): plans then record it."""
        return bool(self.file_seq_length) and self.seq_length != self.file_seq_length

    @property
    def input_seq_length(self) -> int:
        """Tokens per sample entering the first stage (the encoder's, or the only sequence)."""
        return self.encoder_seq_length or self.decoder_seq_length

    @property
    def is_encoder_decoder(self) -> bool:
        return self.architecture == "encoder-decoder"

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Profile kinds of the transformer layers, one per segment in pipeline order."""
        return ("encoder", "decoder") if self.is_encoder_decoder else ("layer",)

    @property
    def segment_layers(self) -> tuple[int, ...]:
        if self.is_encoder_decoder:
            return (self.encoder_num_layers, self.decoder_num_layers)
        return (self.num_layers,)

    @property
    def precision_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def high_precision(self) -> str:
        """The dtype of weights, activations and every kernel but the FP8 GEMMs: bf16 for an fp8 model."""
        return "bf16" if self.precision == "fp8" else self.precision

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"

    @property
    def attention_width(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_width(self) -> int:
        return self.num_query_groups * self.kv_channels

    @cache
    def padded_vocab(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp."""
        unit = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // unit) * unit

    # -- Mixture-of-Experts layers -----------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @cache
    def moe_layers(self, kind: str) -> int:
        """MoE layers of the segment of profile kind `kind`: Megatron-LM's --moe-layer-freq, an integer k making
        layer i (0-based, in each segment) an MoE layer iff i % k == 0, or one 0/1 per layer of the model."""
        if not self.is_moe:
            return 0
        segment = self.layer_kinds.index(kind)
        if isinstance(self.moe_layer_freq, int):
            return -(-self.segment_layers[segment] // self.moe_layer_freq)
        start = sum(self.segment_layers[:segment])
        return sum(self.moe_layer_freq[start:start + self.segment_layers[segment]])

    def moe_share(self, kind: str) -> float:
        """The MoE layers' share of the layers of segment `kind`: a stage's layers are costed as the segment's
        mean layer (docs/cost-model.md section 13)."""
        return self.moe_layers(kind) / self.segment_layers[self.layer_kinds.index(kind)]

    # -- parameters (counts, whole model; a tensor-parallel rank holds 1/tp of each) ----------------
    def _norm_params(self) -> int:
        return 2 * self.hidden_size if self.normalization == "layernorm" else self.hidden_size

    def _attention_params(self) -> int:
        h = self.hidden_size
        if self.multi_latent_attention:  # Megatron-core's MLA modules, their low-rank norms included
            heads, qk = self.num_attention_heads, self.qk_head_dim + self.qk_pos_emb_head_dim
            q = h * heads * qk if not self.q_lora_rank else h * self.q_lora_rank + self.q_lora_rank * (1 + heads * qk)
            kv = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + self.kv_lora_rank * (
                1 + heads * (self.qk_head_dim + self.v_head_dim))
            return q + kv + heads * self.v_head_dim * h
        qa, kv = self.attention_width, self.kv_width
        bias = (qa + 2 * kv + h) if self.linear_bias else 0
        return h * qa + 2 * h * kv + qa * h + bias

    def _mlp_params(self, ffn: int | None = None) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size if ffn is None else ffn
        if self.ffn_activation == "swiglu":
            return 3 * h * f + ((2 * f + h) if self.linear_bias else 0)
        return 2 * h * f + ((f + h) if self.linear_bias else 0)

    def unit_layer_params(self, kind: str, moe: bool = False) -> int:
        """Parameters of one transformer layer of segment `kind`, dense or MoE (router, shared experts and every
        routed expert in place of the FFN): a profile unit's."""
        params = self._attention_params() + 2 * self._norm_params()
        if moe:
            shared = self.moe_shared_expert_intermediate_size
            params += (self.num_experts * (self.hidden_size + (1 if self.linear_bias else 0))
                       + (self._mlp_params(shared) if shared else 0) + self.expert_params())
        else:
            params += self._mlp_params()
        if kind == "decoder" and self.is_encoder_decoder:  # cross-attention and its norm
            params += self._attention_params() + self._norm_params()
        return params

    def expert_params(self) -> int:
        """Parameters of one MoE layer's routed experts, all of them (split over the expert-parallel ranks)."""
        return self.num_experts * self._mlp_params(self.expert_ffn_hidden_size) if self.is_moe else 0

    @cache
    def layer_params(self, kind: str) -> float:
        """Parameters of the mean transformer layer of profile kind `kind`'s segment (one layer of a dense
        model)."""
        share = self.moe_share(kind)
        dense = self.unit_layer_params(kind) if share < 1 else 0
        return (1 - share) * dense + share * self.unit_layer_params(kind, moe=True) if share else float(dense)

    @cache
    def layer_expert_params(self, kind: str) -> float:
        """Of layer_params, the routed experts' (0 for a dense model)."""
        return self.moe_share(kind) * self.expert_params()

    @cache
    def embedding_params(self, tp: int) -> float:
        """Per tensor-parallel rank: the vocabulary-parallel word embedding and learned positions."""
        positions = self.input_seq_length if self.position_embedding == "learned" else 0
        return self.padded_vocab(tp) * self.hidden_size / tp + positions * self.hidden_size

    @cache
    def decoder_embedding_params(self, tp: int) -> float:
        """Per rank, encoder-decoder models: the decoder's copy of the shared word embedding."""
        positions = self.decoder_seq_length if self.position_embedding == "learned" else 0
        return self.padded_vocab(tp) * self.hidden_size / tp + positions * self.hidden_size

    @cache
    def head_params(self, tp: int, shares_stage_with_embedding: bool) -> float:
        """Per rank: final norm, output projection (a copy when tied and on another stage), BERT heads."""
        h = self.hidden_size
        params = float(self._norm_params())
        if not self.tie_embeddings or not shares_stage_with_embedding:
            params += self.padded_vocab(tp) * h / tp
        if self.architecture == "encoder":  # Megatron BERT: LM transform, output bias, pooler, binary head
            params += (h * h + h + self._norm_params()) + self.padded_vocab(tp) / tp + (h * h + h) + (2 * h + 2)
        return params

    def total_params(self) -> float:
        layers = sum(n * self.layer_params(k) for n, k in zip(self.segment_layers, self.layer_kinds))
        embeddings = self.embedding_params(1)
        if self.is_encoder_decoder and self.position_embedding == "learned":
            embeddings += self.decoder_seq_length * self.hidden_size
        return layers + embeddings + self.head_params(1, shares_stage_with_embedding=True)


Layers = Annotated[int, Range(1, MAX_LAYERS)]
Width = Annotated[int, Range(1, MAX_WIDTH)]
Heads = Annotated[int, Range(1, MAX_HEADS)]
SeqLength = Annotated[int, Range(1, MAX_SEQ_LENGTH)]


class ModelTable(Table):
    """The [model] table of a model file (docs/formats.md); absent optional fields are None."""

    name: Name
    source: Text = ""
    architecture: Literal["decoder", "encoder", "encoder-decoder"]
    num_layers: Layers | None = None  # decoder and encoder architectures
    encoder_num_layers: Layers | None = None  # encoder-decoder only, as the three below
    decoder_num_layers: Layers | None = None
    seq_length: SeqLength | None = None
    encoder_seq_length: SeqLength | None = None
    decoder_seq_length: SeqLength | None = None
    hidden_size: Width
    num_attention_heads: Heads
    kv_channels: Width | None = None  # default hidden_size / num_attention_heads
    num_query_groups: Heads | None = None  # default num_attention_heads
    ffn_hidden_size: Annotated[int, Range(1, 4 * MAX_WIDTH)] | None = None  # default 4 * hidden_size
    vocab_size: Annotated[int, Range(1, MAX_VOCAB)]
    tie_embeddings: Flag = True
    position_embedding: Literal["learned", "rope", "relative"] = "learned"
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    ffn_activation: Literal["gelu", "swiglu", "squared-relu"] = "gelu"
    flash_attention: Flag = False
    dropout: Flag = True
    linear_bias: Flag = True
    precision: Literal["fp16", "bf16", "fp32", "fp8"] = "bf16"
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] | None = None
    fp8_param_gather: Flag | None = None
    grad_reduce_in_bf16: Flag = False
    use_precision_aware_optimizer: Flag = False
    main_params_dtype: Literal["fp32", "fp16", "none"] = "fp32"
    exp_avg_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    exp_avg_sq_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    num_experts: Annotated[int, Range(1, MAX_EXPERTS)] | None = None
    moe_router_topk: Annotated[int, Range(1, MAX_EXPERTS)] | None = None  # default 2, Megatron-LM's
    moe_ffn_hidden_size: Annotated[int, Range(1, 4 * MAX_WIDTH)] | None = None  # default ffn_hidden_size
    moe_shared_expert_intermediate_size: Annotated[int, Range(1, 4 * MAX_WIDTH)] | None = None
    moe_layer_freq: Annotated[int | list[int], expected(
        "an integer k >= 1 (every k-th layer) or a list of 0 and 1, one per layer")] | None = None
    moe_capacity_factor: Annotated[float, Range(0, 1024, low_allowed=False)] | None = None
    moe_load_imbalance: Annotated[float, Range(1, 1024)] | None = None
    multi_latent_attention: Flag = False
    q_lora_rank: Width | None = None
    kv_lora_rank: Width | None = None
    qk_head_dim: Width | None = None
    qk_pos_emb_head_dim: Width | None = None
    v_head_dim: Width | None = None
    global_batch_size: Annotated[int, Range(1, 2**31 - 1)]
    make_vocab_size_divisible_by: Width = 128


class ModelFile(Table):
    model: ModelTable
    training: dict = {}  # hyperparameters of a full run, read by fasop.inputs.training where a run is emitted


_ONE_SEGMENT = ("num_layers", "seq_length")
_TWO_SEGMENTS = ("encoder_num_layers", "decoder_num_layers", "encoder_seq_length", "decoder_seq_length")


def _segments(table: ModelTable, where: str) -> tuple[int, int, int, int]:
    """(encoder layers, decoder layers, encoder sequence length, decoder sequence length)."""
    two = table.architecture == "encoder-decoder"
    wanted, refused = (_TWO_SEGMENTS, _ONE_SEGMENT) if two else (_ONE_SEGMENT, _TWO_SEGMENTS)
    for key in refused:
        if getattr(table, key) is not None:
            raise InputError(f"{where}.{key}", f"{table.architecture} models give {', '.join(wanted)} instead")
    given = {key: getattr(table, key) for key in wanted}
    for key, value in given.items():
        if value is None:
            raise InputError(f"{where}.{key}", "missing")
    if two:
        enc_layers, dec_layers, enc_seq, dec_seq = (given[key] for key in _TWO_SEGMENTS)
        return enc_layers, dec_layers, enc_seq, dec_seq
    if table.architecture == "encoder":
        return given["num_layers"], 0, given["seq_length"], 0
    return 0, given["num_layers"], 0, given["seq_length"]


def load_model(model_name: str) -> Model:
    """Load a model by bundled name (`gpt2-xl`, `bert`, `t5`, ...) or from a TOML file."""
    path, is_bundled = bundled.locate("models", model_name, ".toml", "model_name")
    table = validated(ModelFile, read_toml(path), str(path)).model
    where = f"{path}: model"
    enc_layers, dec_layers, enc_seq, dec_seq = _segments(table, where)
    hidden, heads = table.hidden_size, table.num_attention_heads
    if table.kv_channels is None and hidden % heads:
        raise InputError(f"{where}.num_attention_heads", f"must divide hidden_size {hidden} (or give kv_channels)")
    groups = heads if table.num_query_groups is None else table.num_query_groups
    if heads % groups:
        raise InputError(f"{where}.num_query_groups", f"must divide num_attention_heads {heads}")
    if table.grad_reduce_in_bf16 and table.precision not in ("bf16", "fp8"):
        raise InputError(f"{where}.grad_reduce_in_bf16", f"true only with precision = \"bf16\" or \"fp8\", got "
                                                         f"{table.precision!r}")
    for key in ("fp8_recipe", "fp8_param_gather"):
        if getattr(table, key) is not None and table.precision != "fp8":
            raise InputError(f"{where}.{key}", f"only with precision = \"fp8\", got {table.precision!r}")
    for key in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(table, key) != "fp32" and not table.use_precision_aware_optimizer:
            raise InputError(f"{where}.{key}", "other than \"fp32\" only with use_precision_aware_optimizer = true, "
                                               f"as Megatron-LM asserts; got {getattr(table, key)!r}")
    moe, mla = _experts(table, where, enc_layers + dec_layers), _latent_attention(table, where)
    return Model(
        name=table.name, architecture=table.architecture,
        encoder_num_layers=enc_layers, decoder_num_layers=dec_layers,
        hidden_size=hidden, num_attention_heads=heads,
        kv_channels=hidden // heads if table.kv_channels is None else table.kv_channels, num_query_groups=groups,
        ffn_hidden_size=4 * hidden if table.ffn_hidden_size is None else table.ffn_hidden_size,
        encoder_seq_length=enc_seq, decoder_seq_length=dec_seq,
        vocab_size=table.vocab_size,
        tie_embeddings=table.tie_embeddings,
        position_embedding=table.position_embedding,
        normalization=table.normalization,
        ffn_activation=table.ffn_activation,
        flash_attention=table.flash_attention,
        dropout=table.dropout,
        linear_bias=table.linear_bias,
        precision=table.precision,
        fp8_recipe=table.fp8_recipe or "delayed",
        fp8_param_gather=bool(table.fp8_param_gather),
        grad_reduce_in_bf16=table.grad_reduce_in_bf16,
        use_precision_aware_optimizer=table.use_precision_aware_optimizer,
        main_params_dtype=table.main_params_dtype,
        exp_avg_dtype=table.exp_avg_dtype,
        exp_avg_sq_dtype=table.exp_avg_sq_dtype,
        **moe, **mla,
        global_batch_size=table.global_batch_size,
        make_vocab_size_divisible_by=table.make_vocab_size_divisible_by,
        source=table.source,
        file=model_name if is_bundled else str(path),
        file_seq_length=dec_seq or enc_seq,
        defaulted=tuple(name for name in ASSUMED_FIELDS if name not in table.model_fields_set),
    )


def _experts(table: ModelTable, where: str, num_layers: int) -> dict:
    """The Model fields of the file's Mixture-of-Experts layers, checked (none for a dense model)."""
    if table.num_experts is None:
        for key in MOE_FIELDS:
            if getattr(table, key) is not None:
                raise InputError(f"{where}.{key}", "only with num_experts (a Mixture-of-Experts model)")
        return {}
    topk = 2 if table.moe_router_topk is None else table.moe_router_topk
    if topk > table.num_experts:
        raise InputError(f"{where}.moe_router_topk", f"expected at most num_experts = {table.num_experts}, got {topk}")
    given = 1 if table.moe_layer_freq is None else table.moe_layer_freq
    freq: int | tuple[int, ...]
    if isinstance(given, list):
        if len(given) != num_layers or not set(given) <= {0, 1} or not any(given):
            raise InputError(f"{where}.moe_layer_freq", f"expected {num_layers} entries of 0 or 1 (one per layer, at "
                                                        f"least one 1), got {len(given)} entries")
        freq = tuple(given)
    elif not 1 <= given <= num_layers:
        raise InputError(f"{where}.moe_layer_freq", f"expected an integer from 1 to {num_layers}, got {given}")
    else:
        freq = given
    return {"num_experts": table.num_experts, "moe_router_topk": topk,
            "moe_ffn_hidden_size": table.moe_ffn_hidden_size or 0,
            "moe_shared_expert_intermediate_size": table.moe_shared_expert_intermediate_size or 0,
            "moe_layer_freq": freq, "moe_capacity_factor": table.moe_capacity_factor,
            "moe_load_imbalance": 1.0 if table.moe_load_imbalance is None else table.moe_load_imbalance}


def _latent_attention(table: ModelTable, where: str) -> dict:
    """The Model fields of multi-latent attention, checked: every rank and head dimension given (Megatron-LM's
    --kv-lora-rank defaults to 32, not the models' 512, so a file states them all)."""
    if not table.multi_latent_attention:
        for key in ("q_lora_rank", *MLA_FIELDS):
            if getattr(table, key) is not None:
                raise InputError(f"{where}.{key}", "only with multi_latent_attention = true")
        return {}
    for key in MLA_FIELDS:
        if getattr(table, key) is None:
            raise InputError(f"{where}.{key}", "missing (multi_latent_attention = true)")
    if table.num_query_groups not in (None, table.num_attention_heads):
        raise InputError(f"{where}.num_query_groups", "multi-latent attention has no query groups: leave it out")
    return {"multi_latent_attention": True, "q_lora_rank": table.q_lora_rank or 0,
            **{key: getattr(table, key) for key in MLA_FIELDS}}


def with_seq_length(model: Model, seq_length: int) -> Model:
    """`model` trained on samples of `seq_length` tokens (`--seq-length`, for long-context plans)."""
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or not 1 <= seq_length <= MAX_SEQ_LENGTH:
        raise ArgumentError("seq_length", f"expected an integer from 1 to {MAX_SEQ_LENGTH:,}", seq_length)
    if model.is_encoder_decoder:
        raise ArgumentError("seq_length", "applies to one-sequence models; an encoder-decoder model gives "
                                          "encoder_seq_length and decoder_seq_length in its file", seq_length)
    if model.architecture == "encoder":
        return replace(model, encoder_seq_length=seq_length)
    return replace(model, decoder_seq_length=seq_length)


def with_precision(model: Model, precision: str, fp8_recipe: str | None = None,
                   fp8_param_gather: bool | None = None) -> Model:
    """`model` trained in `precision` (PRECISIONS); for fp8, with `fp8_recipe` and `fp8_param_gather` where given
    (else the model file's, or Megatron-LM's defaults: delayed scaling, parameters gathered in bf16)."""
    if precision not in PRECISIONS:
        raise ArgumentError("precision", f"expected one of {', '.join(PRECISIONS)}", precision)
    if precision != "fp8" and (fp8_recipe is not None or fp8_param_gather):
        raise ArgumentError("fp8_recipe" if fp8_recipe is not None else "fp8_param_gather",
                            f"applies to precision fp8 only, not {precision}")
    if fp8_recipe is not None and fp8_recipe not in FP8_RECIPES:
        raise ArgumentError("fp8_recipe", f"expected one of {', '.join(FP8_RECIPES)}", fp8_recipe)
    recipe = fp8_recipe or (model.fp8_recipe if model.fp8 else "delayed")
    gather = fp8_param_gather if fp8_param_gather is not None else (model.fp8_param_gather if model.fp8 else False)
    grad_in_bf16 = model.grad_reduce_in_bf16 and precision in ("bf16", "fp8")
    return replace(model, precision=precision, fp8_recipe=recipe if precision == "fp8" else "delayed",
                   fp8_param_gather=gather if precision == "fp8" else False, grad_reduce_in_bf16=grad_in_bf16)
