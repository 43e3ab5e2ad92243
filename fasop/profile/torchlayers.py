"""The units of a profile (embedding, transformer layer, head) as PyTorch modules with a model file's shape,
split over a tensor-parallel group the way Megatron-LM splits them. Used by `fasop profile layers`.

Tensor parallelism (Megatron-LM's, without sequence parallelism): the Q/K/V and first FFN projections are
column-parallel (each rank holds heads / tp query heads, query_groups / tp key-value groups and ffn / tp
FFN columns) and take their replicated input through `copy_to_group`, whose backward all-reduces the input
gradient; the attention output and second FFN projections are row-parallel and all-reduce their output in
`reduce_from_group`, with the bias added after the reduction. The word embedding and the output layer are
split over the (padded) vocabulary; the loss is Megatron's vocabulary-parallel cross-entropy.

Every weight is drawn at full size from a seeded generator and each rank keeps its slice, so the same seed
gives the same function at every tensor degree (tests compare tp=2 with tp=1).

MoE layers run every expert on this rank (no expert parallelism; the cost model prices that from the roofline),
one GEMM pair per expert; multi-latent attention follows megatron-core's modules.

Left out: BERT's token-type embedding and padding mask, T5's relative position bias (position_embedding =
"relative" builds no position term), Megatron's fused kernels (bias-GELU, masked softmax) and fp32 main
gradients. Attention always goes through torch.nn.functional.scaled_dot_product_attention, which picks a
flash or memory-efficient kernel where it can, also for models whose file says flash_attention = false.

This module imports torch: only `fasop profile layers` loads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fasop.inputs.model import Model

DROPOUT_P = 0.1  # Megatron-LM's default attention and hidden dropout
INIT_STD = 0.02  # Megatron-LM's default init_method_std
ROPE_BASE = 10000.0
NORM_EPS = 1e-5


# -- the tensor-parallel group ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """This process's place in the tensor-parallel group (the default process group when size > 1)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, op=op)
        return tensor


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad.contiguous()), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward (the partial sums of a row-parallel layer); identity backward."""

    @staticmethod
    def forward(ctx, tensor, group):
        return group.all_reduce(tensor.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToGroup.apply(tensor, group) if group.size > 1 else tensor


def reduce_from_group(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceFromGroup.apply(tensor, group) if group.size > 1 else tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split over the vocabulary: each rank holds a slice of the columns.

    The maximum, the target's logit and the sum of exponentials are reduced over the group; the gradient
    (softmax minus one-hot, on the local slice) needs no communication.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()
        top = group.all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        local = target - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        group.all_reduce(target_logit)
        group.all_reduce(sum_exp)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None


# -- weights: drawn at full size, sliced per rank ---------------------------------------------------------------
class Init:
    """Seeded full-size weights; each call draws the next tensor, so every rank draws the same sequence."""

    def __init__(self, seed: int, dtype: torch.dtype, device: torch.device):
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.dtype, self.device = dtype, device

    def normal(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator) * INIT_STD

    def param(self, full: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(full.to(device=self.device, dtype=self.dtype).contiguous())


def _rows(full: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's slice of the first dimension (column-parallel weights, vocabulary slices)."""
    return full.chunk(group.size, dim=0)[group.rank]


def _columns(full: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's slice of the second dimension (row-parallel weights)."""
    return full.chunk(group.size, dim=1)[group.rank]


def _bias(init: Init, size: int, present: bool) -> nn.Parameter | None:
    return init.param(torch.zeros(size)) if present else None


def _linear(init: Init, out_features: int, in_features: int) -> nn.Linear:
    """A replicated (not split) dense layer with a seeded weight and a zero bias."""
    linear = nn.Linear(in_features, out_features, device=init.device, dtype=init.dtype)
    linear.weight, linear.bias = init.param(init.normal(out_features, in_features)), _bias(init, out_features, True)
    return linear


def _norm(model: Model, init: Init) -> nn.Module:
    if model.normalization == "rmsnorm":
        norm = nn.RMSNorm(model.hidden_size, eps=NORM_EPS)
    else:
        norm = nn.LayerNorm(model.hidden_size, eps=NORM_EPS)
    return norm.to(device=init.device, dtype=init.dtype)


def _dropout(model: Model) -> float:
    return DROPOUT_P if model.dropout else 0.0


class Rotary(nn.Module):
    """Rotary position embedding of the query and key heads (rotate-half form, base 10000)."""

    def __init__(self, seq: int, head_dim: int, init: Init):
        super().__init__()
        inverse = 1.0 / ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inverse)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().to(device=init.device, dtype=init.dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(device=init.device, dtype=init.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [b, heads, s, d]
        first, second = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat([-second, first], dim=-1) * self.sin


# -- transformer layer ---------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Self- or cross-attention: column-parallel Q (and K/V), row-parallel output projection."""

    def __init__(self, model: Model, init: Init, group: Group, causal: bool, cross: bool, seq: int):
        super().__init__()
        h, d = model.hidden_size, model.kv_channels
        self.group, self.causal, self.cross, self.dropout_p = group, causal, cross, _dropout(model)
        self.heads = model.num_attention_heads // group.size
        self.groups = model.num_query_groups // group.size
        self.head_dim = d
        q = _rows(init.normal(model.attention_width, h), group)
        k = _rows(init.normal(model.kv_width, h), group)
        v = _rows(init.normal(model.kv_width, h), group)
        bias = model.linear_bias
        if cross:  # queries from the decoder, keys and values from the encoder output
            self.q_weight, self.q_bias = init.param(q), _bias(init, q.shape[0], bias)
            self.kv_weight, self.kv_bias = init.param(torch.cat([k, v])), _bias(init, 2 * k.shape[0], bias)
        else:
            self.qkv_weight = init.param(torch.cat([q, k, v]))
            self.qkv_bias = _bias(init, q.shape[0] + 2 * k.shape[0], bias)
        self.proj_weight = init.param(_columns(init.normal(h, model.attention_width), group))
        self.proj_bias = _bias(init, h, bias)
        rope = model.position_embedding == "rope" and not cross
        self.rotary = Rotary(seq, d, init) if rope else None

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:  # [b, s, count*d] -> [b, count, s, d]
        b, s, _ = x.shape
        return x.view(b, s, count, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = copy_to_group(x, self.group)
        q_width, kv_width = self.heads * self.head_dim, self.groups * self.head_dim
        if self.cross:
            q = F.linear(x, self.q_weight, self.q_bias)
            k, v = F.linear(copy_to_group(memory, self.group), self.kv_weight, self.kv_bias).split(kv_width, dim=-1)
        else:
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split([q_width, kv_width, kv_width], dim=-1)
        q, k, v = self._heads(q, self.heads), self._heads(k, self.groups), self._heads(v, self.groups)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        context = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_p if self.training else 0.0, is_causal=self.causal,
            enable_gqa=self.groups != self.heads)
        b, _, s, _ = context.shape
        out = F.linear(context.transpose(1, 2).reshape(b, s, q_width), self.proj_weight)
        out = reduce_from_group(out, self.group)
        return out + self.proj_bias if self.proj_bias is not None else out


class MLP(nn.Module):
    """GELU (h -> ffn -> h) or SwiGLU (gate and up projections, silu(gate) x up, down projection); `ffn`: its
    width where not the model's (shared experts)."""

    def __init__(self, model: Model, init: Init, group: Group, ffn: int | None = None):
        super().__init__()
        h, f = model.hidden_size, model.ffn_hidden_size if ffn is None else ffn
        self.group, self.swiglu = group, model.ffn_activation == "swiglu"
        pieces = [_rows(init.normal(f, h), group) for _ in range(2 if self.swiglu else 1)]
        self.fc1_weight = init.param(torch.cat(pieces))
        self.fc1_bias = _bias(init, self.fc1_weight.shape[0], model.linear_bias)
        self.fc2_weight = init.param(_columns(init.normal(h, f), group))
        self.fc2_bias = _bias(init, h, model.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.linear(copy_to_group(x, self.group), self.fc1_weight, self.fc1_bias)
        if self.swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden)
        out = reduce_from_group(F.linear(hidden, self.fc2_weight), self.group)
        return out + self.fc2_bias if self.fc2_bias is not None else out


class LatentAttention(nn.Module):
    """Multi-latent attention as megatron-core builds it: the low-rank down-projections of the queries (when
    compressed) and of the keys and values with the shared rotary key, on every rank (replicated), their norms,
    the up-projections split over the group by heads, rotary embedding of the rotary parts, attention of
    qk_head_dim + qk_pos_emb_head_dim wide queries and keys over v_head_dim wide values, the row-parallel output
    projection. No biases."""

    def __init__(self, model: Model, init: Init, group: Group, seq: int):
        super().__init__()
        h, heads = model.hidden_size, model.num_attention_heads
        self.group, self.dropout_p = group, _dropout(model)
        self.heads = heads // group.size
        self.nope, self.rope, self.v = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
        self.q_rank, self.kv_rank = model.q_lora_rank, model.kv_lora_rank
        qk = self.nope + self.rope
        if self.q_rank:
            self.q_down = init.param(init.normal(self.q_rank, h))
            self.q_norm = nn.RMSNorm(self.q_rank, eps=NORM_EPS).to(device=init.device, dtype=init.dtype)
            self.q_up = init.param(_rows(init.normal(heads * qk, self.q_rank), group))
        else:
            self.q_proj = init.param(_rows(init.normal(heads * qk, h), group))
        self.kv_down = init.param(init.normal(self.kv_rank + self.rope, h))
        self.kv_norm = nn.RMSNorm(self.kv_rank, eps=NORM_EPS).to(device=init.device, dtype=init.dtype)
        self.kv_up = init.param(_rows(init.normal(heads * (self.nope + self.v), self.kv_rank), group))
        self.proj_weight = init.param(_columns(init.normal(h, heads * self.v), group))
        self.rotary = Rotary(seq, self.rope, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_group(x, self.group)
        b, s, _ = x.shape
        q = F.linear(self.q_norm(F.linear(x, self.q_down)), self.q_up) if self.q_rank else F.linear(x, self.q_proj)
        q = q.view(b, s, self.heads, self.nope + self.rope).transpose(1, 2)
        latent, k_rope = F.linear(x, self.kv_down).split([self.kv_rank, self.rope], dim=-1)
        kv = F.linear(self.kv_norm(latent), self.kv_up).view(b, s, self.heads, self.nope + self.v).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        k_rope = self.rotary(k_rope.unsqueeze(1)).expand(b, self.heads, s, self.rope)
        q = torch.cat([q_nope, self.rotary(q_rope)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
                                                 is_causal=True)
        out = F.linear(context.transpose(1, 2).reshape(b, s, self.heads * self.v), self.proj_weight)
        return reduce_from_group(out, self.group)


class Experts(nn.Module):
    """A Mixture-of-Experts FFN on one rank, every expert local (no expert parallelism) and split over the group
    (expert tensor parallelism = tp, Megatron-LM's default): the router (h x E, its scores in fp32), softmax and
    top-k, the tokens sorted into expert order, each expert's FFN on its tokens (one GEMM pair per expert that
    has tokens, where Megatron's grouped GEMM launches one: a profile taken here keeps the host's launches per
    expert), the outputs weighted by their scores and scattered back, the row-parallel sum all-reduced, and the
    shared experts as a dense FFN beside."""

    def __init__(self, model: Model, init: Init, group: Group):
        super().__init__()
        h, e, f = model.hidden_size, model.num_experts, model.expert_ffn_hidden_size
        self.group, self.topk, self.swiglu = group, model.moe_router_topk, model.ffn_activation == "swiglu"
        self.router = init.param(init.normal(e, h))
        self.router_bias = _bias(init, e, model.linear_bias)
        pieces = 2 if self.swiglu else 1
        # a parameter per expert: autograd then writes each expert's weight gradient alone (a slice of one stacked
        # parameter would add a zero-filled gradient of every expert's weights per expert)
        self.fc1 = nn.ParameterList([init.param(torch.cat([_rows(init.normal(f, h), group) for _ in range(pieces)]))
                                     for _ in range(e)])
        self.fc2 = nn.ParameterList([init.param(_columns(init.normal(h, f), group)) for _ in range(e)])
        self.fc1_bias = nn.ParameterList([init.param(torch.zeros(self.fc1[0].shape[0])) for _ in range(e)]
                                         if model.linear_bias else [])
        self.fc2_bias = _bias(init, e * h, model.linear_bias)
        shared = model.moe_shared_expert_intermediate_size
        self.shared = MLP(model, init, group, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = copy_to_group(x.reshape(b * s, h), self.group)
        bias = self.router_bias.float() if self.router_bias is not None else None
        scores = F.linear(tokens.float(), self.router.float(), bias).softmax(dim=-1)
        weights, chosen = scores.topk(self.topk, dim=-1)
        order = chosen.reshape(-1).argsort(stable=True)
        source = order // self.topk  # the token each routed copy comes from, in expert order
        counts = torch.bincount(chosen.reshape(-1), minlength=len(self.fc1)).tolist()  # the host learns them
        routed = tokens[source]
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                hidden = F.linear(routed[start:start + count], self.fc1[expert],
                                  self.fc1_bias[expert] if len(self.fc1_bias) else None)
                if self.swiglu:
                    gate, up = hidden.chunk(2, dim=-1)
                    hidden = F.silu(gate) * up
                else:
                    hidden = F.gelu(hidden)
                outputs.append(F.linear(hidden, self.fc2[expert]))
                start += count
        weighted = torch.cat(outputs) * weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        out = reduce_from_group(torch.zeros_like(tokens).index_add(0, source, weighted), self.group)
        if self.fc2_bias is not None:  # each chosen expert's output bias, weighted, once after the sum
            out = out + (weights.unsqueeze(-1).to(x.dtype) * self.fc2_bias.view(-1, h)[chosen]).sum(dim=1)
        out = out.view(b, s, h)
        return out + self.shared(x) if self.shared is not None else out


class TransformerLayer(nn.Module):
    """Pre-norm layer: x + attention(norm(x)) [+ cross-attention], then + MLP(norm(x)) (an MoE layer's experts
    with `moe`), dropout on each branch."""

    def __init__(self, model: Model, kind: str, init: Init, group: Group, moe: bool = False):
        super().__init__()
        self.cross = kind == "decoder" and model.is_encoder_decoder
        seq = model.layer_seq_length(kind)
        causal = model.architecture != "encoder" and kind != "encoder"
        self.dropout_p = _dropout(model)
        self.input_norm = _norm(model, init)
        self.attention: nn.Module = (LatentAttention(model, init, group, seq) if model.multi_latent_attention else
                                     Attention(model, init, group, causal=causal, cross=False, seq=seq))
        if self.cross:
            self.cross_norm = _norm(model, init)
            self.cross_attention = Attention(model, init, group, causal=False, cross=True, seq=seq)
        self.mlp_norm = _norm(model, init)
        self.mlp: nn.Module = Experts(model, init, group) if moe else MLP(model, init, group)

    def _residual(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(branch, self.dropout_p, self.training)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = self._residual(x, self.attention(self.input_norm(x)))
        if self.cross:
            x = self._residual(x, self.cross_attention(self.cross_norm(x), memory))
        return self._residual(x, self.mlp(self.mlp_norm(x)))


# -- embedding and head ----------------------------------------------------------------------------------------
class Embedding(nn.Module):
    """Vocabulary-parallel word embedding (all-reduced over the group) plus learned positions, then dropout."""

    def __init__(self, model: Model, seq: int, init: Init, group: Group):
        super().__init__()
        vocab = model.padded_vocab(group.size)
        self.group, self.dropout_p = group, _dropout(model)
        self.word = init.param(_rows(init.normal(vocab, model.hidden_size), group))
        self.vocab_start = group.rank * vocab // group.size
        learned = model.position_embedding == "learned"
        self.position = init.param(init.normal(seq, model.hidden_size)) if learned else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.word.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.word).masked_fill(outside.unsqueeze(-1), 0.0)
        out = reduce_from_group(out, self.group)
        if self.position is not None:
            out = out + self.position[: ids.shape[1]]
        return F.dropout(out, self.dropout_p, self.training)


class Head(nn.Module):
    """Final norm, vocabulary-parallel output layer and cross-entropy (mean over tokens).

    BERT (architecture "encoder") adds Megatron's LM-head transform (dense, GELU, norm) and output bias before
    the output layer, and the pooler and binary (next-sentence) head on the first token.
    """

    def __init__(self, model: Model, init: Init, group: Group):
        super().__init__()
        h, vocab = model.hidden_size, model.padded_vocab(group.size)
        self.group, self.bert = group, model.architecture == "encoder"
        self.final_norm = _norm(model, init)
        if self.bert:
            self.transform = _linear(init, h, h)
            self.transform_norm = _norm(model, init)
        self.output_weight = init.param(_rows(init.normal(vocab, h), group))
        self.output_bias = init.param(_rows(torch.zeros(vocab), group)) if self.bert else None
        self.vocab_start = group.rank * vocab // group.size
        if self.bert:
            self.pooler, self.binary = _linear(init, h, h), _linear(init, 2, h)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.final_norm(x)
        hidden = self.transform_norm(F.gelu(self.transform(x))) if self.bert else x
        logits = F.linear(copy_to_group(hidden, self.group), self.output_weight, self.output_bias)
        loss = _VocabParallelCrossEntropy.apply(logits, labels, self.vocab_start, self.group).mean()
        if self.bert:
            pooled = torch.tanh(self.pooler(x[:, 0]))
            loss = loss + F.cross_entropy(self.binary(pooled).float(), labels[:, 0] % 2)
        return loss


# -- units with their inputs -----------------------------------------------------------------------------------
@dataclass
class Unit:
    """One profile unit: its module, and a maker of one micro-batch of inputs (tensors needing gradients
    where the unit's backward produces one). `forward(*inputs)` returns the output or the loss."""

    kind: str
    module: nn.Module
    make_inputs: Callable[[int, torch.Generator], tuple]

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def build_unit(model: Model, kind: str, group: Group, dtype: torch.dtype, device: torch.device,
               seed: int = 0) -> Unit:
    """The unit `kind` (one of fasop.inputs.profiles.required_kinds(model)) on this rank of `group`."""
    init = Init(seed, dtype, device)
    h, vocab = model.hidden_size, model.vocab_size

    def hidden(mbs: int, seq: int, generator: torch.Generator) -> torch.Tensor:
        x = torch.randn(mbs, seq, h, generator=generator)
        return x.to(device=device, dtype=dtype).requires_grad_()

    def token_ids(mbs: int, seq: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, vocab, (mbs, seq), generator=generator).to(device)

    if kind in ("embedding", "decoder_embedding"):
        seq = model.decoder_seq_length if kind == "decoder_embedding" else model.input_seq_length
        return Unit(kind, Embedding(model, seq, init, group), lambda mbs, g: (token_ids(mbs, seq, g),))
    if kind == "head":
        seq = model.seq_length
        return Unit(kind, Head(model, init, group), lambda mbs, g: (hidden(mbs, seq, g), token_ids(mbs, seq, g)))
    segment = kind.removeprefix("moe_")  # an MoE layer's kind is moe_ and its segment's
    layer = TransformerLayer(model, segment, init, group, moe=kind != segment)
    if layer.cross:
        s, s_enc = model.decoder_seq_length, model.encoder_seq_length
        return Unit(kind, layer, lambda mbs, g: (hidden(mbs, s, g), hidden(mbs, s_enc, g)))
    seq = model.layer_seq_length(segment)
    return Unit(kind, layer, lambda mbs, g: (hidden(mbs, seq, g),))


def output_gradient(output: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """A fixed random gradient for a tensor output (None for a scalar loss, whose gradient is 1)."""
    if output.dim() == 0:
        return None
    grad = torch.randn(output.shape, generator=generator) / math.sqrt(output.numel())
    return grad.to(device=output.device, dtype=output.dtype)
