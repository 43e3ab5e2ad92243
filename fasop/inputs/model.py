"""The model description: shape, parameter counts and activation sizes of one Transformer.

Parameter and activation counts follow Megatron-LM's layer structure. Activation bytes generalise the
per-layer formula of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", Table 2: 34*s*b*h + 5*a*s^2*b bytes) to other attention widths, grouped-query attention, SwiGLU,
flash attention and models without dropout; docs/cost-model.md derives every term.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from fasop.errors import InputError
from fasop.inputs import bundled
from fasop.inputs.names import table_name
from fasop.inputs.tomlfile import Table, read_toml

ARCHITECTURES = ("decoder", "encoder", "encoder-decoder")
PRECISION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
DROPOUT_MASK_BYTES = 1
# Ranges of the shape fields of a model file (docs/formats.md): beyond any trained Transformer, small enough
# that parameter, activation and FLOP counts stay finite.
MAX_LAYERS = 10_000
MAX_WIDTH = 2**20  # hidden_size, kv_channels (ffn_hidden_size: 4x)
MAX_HEADS = 2**16
MAX_SEQ_LENGTH = 2**24
MAX_VOCAB = 2**24


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
    precision: str = "fp16"
    global_batch_size: int = 1
    make_vocab_size_divisible_by: int = 128
    source: str = ""
    file: str = field(default="", compare=False)

    def __hash__(self) -> int:  # cheap: the cached methods below hash the model on every call
        return hash((self.name, self.hidden_size, self.encoder_num_layers, self.decoder_num_layers))

    # -- shape -------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.encoder_num_layers + self.decoder_num_layers

    @property
    def seq_length(self) -> int:
        """Tokens per sample that count as training tokens (the decoder's, or the encoder's alone)."""
        return self.decoder_seq_length or self.encoder_seq_length

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
    def attention_width(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_width(self) -> int:
        return self.num_query_groups * self.kv_channels

    @lru_cache(maxsize=None)
    def padded_vocab(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp."""
        unit = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // unit) * unit

    # -- parameters (counts, whole model; a tensor-parallel rank holds 1/tp of each) ----------------
    def _norm_params(self) -> int:
        return 2 * self.hidden_size if self.normalization == "layernorm" else self.hidden_size

    def _attention_params(self) -> int:
        h, qa, kv = self.hidden_size, self.attention_width, self.kv_width
        bias = (qa + 2 * kv + h) if self.linear_bias else 0
        return h * qa + 2 * h * kv + qa * h + bias

    def _mlp_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        if self.ffn_activation == "swiglu":
            return 3 * h * f + ((2 * f + h) if self.linear_bias else 0)
        return 2 * h * f + ((f + h) if self.linear_bias else 0)

    @lru_cache(maxsize=None)
    def layer_params(self, kind: str) -> int:
        """Parameters of one transformer layer of profile kind `kind`."""
        params = self._attention_params() + self._mlp_params() + 2 * self._norm_params()
        if kind == "decoder" and self.is_encoder_decoder:  # cross-attention and its norm
            params += self._attention_params() + self._norm_params()
        return params

    @lru_cache(maxsize=None)
    def embedding_params(self, tp: int) -> float:
        """Per tensor-parallel rank: the vocabulary-parallel word embedding and learned positions."""
        positions = self.input_seq_length if self.position_embedding == "learned" else 0
        return self.padded_vocab(tp) * self.hidden_size / tp + positions * self.hidden_size

    @lru_cache(maxsize=None)
    def decoder_embedding_params(self, tp: int) -> float:
        """Per rank, encoder-decoder models: the decoder's copy of the shared word embedding."""
        positions = self.decoder_seq_length if self.position_embedding == "learned" else 0
        return self.padded_vocab(tp) * self.hidden_size / tp + positions * self.hidden_size

    @lru_cache(maxsize=None)
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

    # -- activations (bytes held for one micro-batch, per GPU, sequence parallelism when tp > 1) ------
    def _attention_activation(self, q_seq: int, kv_seq: int, mbs: int, cross: bool) -> float:
        h, qa, kv, a = self.hidden_size, self.attention_width, self.kv_width, self.num_attention_heads
        p, mask = self.precision_bytes, DROPOUT_MASK_BYTES if self.dropout else 0
        b = mbs
        # input of the norm and of the Q(KV) projection, Q, K, V, input of the output projection, dropout mask
        kv_input = 0 if cross else p * q_seq * b * h  # cross-attention K/V read the shared encoder output
        sbh = p * q_seq * b * h + kv_input + p * q_seq * b * qa + 2 * p * kv_seq * b * kv
        sbh += p * q_seq * b * qa + mask * q_seq * b * h
        if self.flash_attention:
            scores = 0.0
        else:  # softmax output, and with dropout its mask and output
            scores = a * q_seq * kv_seq * b * (p + (mask + p if self.dropout else 0))
        return sbh + scores

    def _mlp_activation(self, seq: int, mbs: int) -> float:
        h, f, p = self.hidden_size, self.ffn_hidden_size, self.precision_bytes
        mask = DROPOUT_MASK_BYTES if self.dropout else 0
        hidden = (3 if self.ffn_activation == "swiglu" else 2) * p * seq * mbs * f
        return p * seq * mbs * h + hidden + mask * seq * mbs * h + p * seq * mbs * h  # + norm input

    @lru_cache(maxsize=None)
    def layer_activation_bytes(self, kind: str, mbs: int, tp: int) -> float:
        """Activation bytes one layer keeps for one micro-batch until its backward pass, per GPU."""
        if kind == "decoder" and self.is_encoder_decoder:
            s, s_enc = self.decoder_seq_length, self.encoder_seq_length
            total = self._attention_activation(s, s, mbs, cross=False)
            total += self._attention_activation(s, s_enc, mbs, cross=True)
            total += self.precision_bytes * s * mbs * self.hidden_size  # the cross-attention norm's input
        else:
            s = self.encoder_seq_length if kind == "encoder" else self.seq_length
            total = self._attention_activation(s, s, mbs, cross=False)
        return (total + self._mlp_activation(s, mbs)) / tp

    @lru_cache(maxsize=None)
    def embedding_activation_bytes(self, mbs: int, tp: int) -> float:
        mask = DROPOUT_MASK_BYTES if self.dropout else 0
        return mask * self.input_seq_length * mbs * self.hidden_size / tp

    @lru_cache(maxsize=None)
    def head_activation_bytes(self, mbs: int, tp: int) -> float:
        """Final norm and output-layer inputs, and the fp32 logits that the cross-entropy loss keeps."""
        s, h = self.seq_length, self.hidden_size
        return (2 * self.precision_bytes * s * mbs * h + 4 * s * mbs * self.padded_vocab(tp)) / tp

    @lru_cache(maxsize=None)
    def boundary_bytes(self, segment: int, mbs: int, tp: int) -> float:
        """Bytes one tensor-parallel rank sends across a pipeline boundary for one micro-batch.

        Megatron scatters the activation over the tensor-parallel group (sequence parallelism), so each
        rank sends 1/tp. Decoder stages of encoder-decoder models also pass the encoder output along.
        """
        tokens = self.input_seq_length if segment == 0 else self.decoder_seq_length + self.encoder_seq_length
        return self.precision_bytes * tokens * mbs * self.hidden_size / tp


_KNOWN = {
    "name", "source", "architecture", "num_layers", "encoder_num_layers", "decoder_num_layers",
    "hidden_size", "num_attention_heads", "kv_channels", "num_query_groups", "ffn_hidden_size",
    "seq_length", "encoder_seq_length", "decoder_seq_length", "vocab_size", "tie_embeddings",
    "position_embedding", "normalization", "ffn_activation", "flash_attention", "dropout", "linear_bias",
    "precision", "global_batch_size", "make_vocab_size_divisible_by",
}


def load_model(name_or_path: str) -> Model:
    """Load a model by bundled name (`gpt2-xl`, `bert`, `t5`, ...) or from a TOML file."""
    path, is_bundled = bundled.locate("models", name_or_path, ".toml", "--model")
    raw = read_toml(path)
    table = Table(raw.get("model"), str(path), "model")
    table.reject_unknown(_KNOWN)
    arch = table.str("architecture", choices=ARCHITECTURES)
    if arch == "encoder-decoder":
        for key in ("num_layers", "seq_length"):
            if key in table.data:
                raise InputError(table.where(key), "encoder-decoder models give encoder_* and decoder_* instead")
        enc_layers = table.int("encoder_num_layers", maximum=MAX_LAYERS)
        dec_layers = table.int("decoder_num_layers", maximum=MAX_LAYERS)
        enc_seq = table.int("encoder_seq_length", maximum=MAX_SEQ_LENGTH)
        dec_seq = table.int("decoder_seq_length", maximum=MAX_SEQ_LENGTH)
    else:
        layers, seq = table.int("num_layers", maximum=MAX_LAYERS), table.int("seq_length", maximum=MAX_SEQ_LENGTH)
        enc_layers, dec_layers = (layers, 0) if arch == "encoder" else (0, layers)
        enc_seq, dec_seq = (seq, 0) if arch == "encoder" else (0, seq)
    hidden = table.int("hidden_size", maximum=MAX_WIDTH)
    heads = table.int("num_attention_heads", maximum=MAX_HEADS)
    if "kv_channels" not in table.data and hidden % heads:
        raise InputError(table.where("num_attention_heads"), f"must divide hidden_size {hidden} (or give kv_channels)")
    groups = table.int("num_query_groups", heads, maximum=MAX_HEADS)
    if heads % groups:
        raise InputError(table.where("num_query_groups"), f"must divide num_attention_heads {heads}")
    model = Model(
        name=table_name(table, "name"), architecture=arch,
        encoder_num_layers=enc_layers, decoder_num_layers=dec_layers,
        hidden_size=hidden, num_attention_heads=heads,
        kv_channels=table.int("kv_channels", hidden // heads, maximum=MAX_WIDTH), num_query_groups=groups,
        ffn_hidden_size=table.int("ffn_hidden_size", 4 * hidden, maximum=4 * MAX_WIDTH),
        encoder_seq_length=enc_seq, decoder_seq_length=dec_seq,
        vocab_size=table.int("vocab_size", maximum=MAX_VOCAB),
        tie_embeddings=table.bool("tie_embeddings", True),
        position_embedding=table.str("position_embedding", "learned", ("learned", "rope", "relative")),
        normalization=table.str("normalization", "layernorm", ("layernorm", "rmsnorm")),
        ffn_activation=table.str("ffn_activation", "gelu", ("gelu", "swiglu")),
        flash_attention=table.bool("flash_attention", False),
        dropout=table.bool("dropout", True),
        linear_bias=table.bool("linear_bias", True),
        precision=table.str("precision", "bf16", tuple(PRECISION_BYTES)),
        global_batch_size=table.int("global_batch_size"),
        make_vocab_size_divisible_by=table.int("make_vocab_size_divisible_by", 128, maximum=MAX_WIDTH),
        source=table.str("source", ""),
        file=name_or_path if is_bundled else str(path),
    )
    return model
