"""The Llama decoder for one device: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or untied head.

Parameter names follow Hugging Face `LlamaForCausalLM` minus its `model.` prefix (`embed_tokens.weight`,
`layers.{i}.self_attn.q_proj.weight`, ..., `norm.weight`, `lm_head.weight`), so a state-dict adapter is a
table. q/k/v and gate/up stay separate matrices so tensor parallelism can split them from outside.

Dtypes: parameters are fp32; the residual stream and matmuls run in `compute_dtype`; RMSNorm, softmax
and the returned logits are fp32. RoPE tables and the causal mask (`attention.CausalMask`) are built once, at
construction.

Generation uses a second path through the same weights: `Llama.decode` runs only the new tokens, writes
their keys and values into a `KVCache` in place and attends over it, as one compiled graph a step. The cache
has one fixed-size slot per position (params.seq_len of them, or fewer when a generation needs fewer), so
every decoding step has the same shapes and compiles once; slots a query may not see are masked out exactly
as the causal mask does in `construct`. Decoding runs a few rows through many small kernels, each costing
more to launch than to run, so its RMSNorm, RoPE and SwiGLU take the fewest kernels (the training path's are
shaped for thousands of rows and a backward): RMSNorm and silu(gate) * up fold their products into Addcmul
kernels, and RoPE is one [D, D] rotation per position, built once a step and applied to a layer's queries and
keys by two batched matmuls, the queries' with the 1 / sqrt(D) of the scores folded in (kernel counts in
benchmarks/README.md, "Generation").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops

from model_core.model.attention import Attention, CausalMask, cached_attention, fused_attention_available
from model_core.model.fused import (
    After,
    HeadsFirst,
    HeadsLast,
    LinearFunction,
    RMSNormFunction,
    RotaryFunction,
    SwiGLUFunction,
    sign_first_half,
)
from model_core.model.init import new_weight
from model_core.model.moe import MoE
from params.schema import ModelParams

ComputeDtype = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": ms.float32, "bfloat16": ms.bfloat16, "float16": ms.float16}


class Linear(nn.Cell):
    """y = x W^T without bias; W is [out, in] like torch.nn.Linear and runs in the dtype of x."""

    def __init__(self, in_features: int, out_features: int, init_std: float):
        super().__init__()
        self.weight = new_weight((out_features, in_features), init_std)
        self.linear = LinearFunction()

    def construct(self, x: Tensor) -> Tensor:
        return self.linear(x, self.weight.astype(x.dtype))


class Embedding(nn.Cell):
    """Token id -> row of a [vocab, hidden] table (`weight`, the name Hugging Face uses)."""

    def __init__(self, vocab_size: int, hidden_size: int, init_std: float):
        super().__init__()
        self.weight = new_weight((vocab_size, hidden_size), init_std)

    def construct(self, tokens: Tensor) -> Tensor:
        return ops.gather(self.weight, tokens, 0)


# a + c * x * y in one kernel (decoding's RMSNorm); its constant operands are Tensors, which the functional form
# would build in Python at every step.
_addcmul = ops.Addcmul()
_ZERO, _ONE = Tensor(0.0, ms.float32), Tensor(1.0, ms.float32)


class RMSNorm(nn.Cell):
    """x / rms(x) * weight, computed in fp32 and returned in the dtype of x."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = new_weight((hidden_size,), None)
        self.rms_norm = RMSNormFunction(eps)
        self.eps = Tensor(eps, ms.float32)  # decoding's, see `construct_cached`

    def construct(self, x: Tensor) -> Tensor:
        return self.rms_norm(x.astype(ms.float32), self.weight).astype(x.dtype)

    def construct_cached(self, x: Tensor) -> Tensor:
        """`construct` for decoding's few rows, in 4 kernels instead of 11: the training path's fp64 matmul mean and
        matmul expansions pay off on thousands of rows, here each kernel's launch costs more than its work. eps is
        added to every square before the mean (the same sum, rounded differently), so each Addcmul does two things."""
        x32 = x.astype(ms.float32)
        inverse_rms = mint.rsqrt(mint.mean(_addcmul(self.eps, x32, x32, _ONE), -1, keepdim=True))  # [..., 1]
        return _addcmul(_ZERO, x32, self.weight, inverse_rms).astype(x.dtype)


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of RoPE angles, [max_positions, head_dim], in the rotate-half layout Hugging Face uses."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)  # [P, D/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [P, D]: the two halves share frequencies
    return Tensor(np.cos(angles), ms.float32), Tensor(np.sin(angles), ms.float32)


def rotation_matrices(cos: Tensor, signed_sin: Tensor, basis: tuple[Tensor, Tensor]) -> Tensor:
    """RoPE as one [D, D] matrix per position: x @ it == x cos + swap_halves(x) signed_sin. cos, signed_sin: [N, D]
    (signed_sin: the sine with its first half negated, `fused.sign_first_half`); basis: `rotation_basis`. Returns
    [N, D, D]. Each output column has one cos and one sine term (diagonal and swapped row), so the product is the
    elementwise formula's."""
    identity, swap_halves = basis
    return identity * cos.unsqueeze(1) + swap_halves * signed_sin.unsqueeze(1)


def rotation_basis(head_dim: int) -> tuple[Tensor, Tensor]:
    """The [D, D] identity, and the permutation with x @ it == [x[D/2:], x[:D/2]] (the swap of `fused.apply_rotary`,
    its sign left on the sine)."""
    identity = np.eye(head_dim, dtype=np.float32)
    return Tensor(identity), Tensor(np.roll(identity, head_dim // 2, axis=1))


class SelfAttention(nn.Cell):
    """Causal multi-head attention with RoPE and grouped-query key/value heads."""

    def __init__(self, params: ModelParams, output_std: float):
        super().__init__()
        hidden, head_dim = params.hidden_size, params.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = params.num_heads, params.num_kv_heads, head_dim
        self.q_proj = Linear(hidden, params.num_heads * head_dim, params.init_std)
        self.k_proj = Linear(hidden, params.num_kv_heads * head_dim, params.init_std)
        self.v_proj = Linear(hidden, params.num_kv_heads * head_dim, params.init_std)
        self.o_proj = Linear(params.num_heads * head_dim, hidden, output_std)
        self.heads_first, self.heads_last = HeadsFirst(), HeadsLast()
        self.rotary = RotaryFunction()
        self.attention = Attention(head_dim, fused_attention_available())

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        # T is the projections' sequence, which a layout may make longer than x's (sequence parallelism gathers it).
        batch = x.shape[0]
        q = self.heads_first(self.q_proj(x).reshape(batch, -1, self.num_heads, self.head_dim))  # [B, H, T, D]
        k = self.heads_first(self.k_proj(x).reshape(batch, -1, self.num_kv_heads, self.head_dim))  # [B, Hkv, T, D]
        v = self.heads_first(self.v_proj(x).reshape(batch, -1, self.num_kv_heads, self.head_dim))
        out = self.attention(self.rotary(q, cos, sin), self.rotary(k, cos, sin), v, mask)
        return self.o_proj(self.heads_last(out).reshape(batch, -1, self.num_heads * self.head_dim))

    def construct_cached(self, x, rotations, visible, cache, rows):
        """Attention of n new tokens over the KV cache, after writing their keys and values into it.

        x: [B, n, hidden]; rotations: RoPE of every new token as [B * n, D, D] matrices (`rotation_matrices`) for the
        queries, scaled by 1 / sqrt(D), and for the keys: one batched matmul a tensor where the elementwise formula
        and the score scaling take 4 and 5 kernels; visible: bool [B, 1, n, S], which cache slots each new token
        sees; cache: the layer's (keys, values) as [B, H_kv, S, D] views for reading, then as flat Parameters
        [B * H_kv * S, D] for writing, and rows [B, H_kv, n], the new slots' rows in them (see `KVCache`). No
        backward runs here, so heads move by swapaxes.
        """
        batch, seq, _ = x.shape
        query_rotation, key_rotation = rotations
        keys, values, flat_keys, flat_values = cache
        q = ops.matmul(self.q_proj(x).reshape(batch * seq, self.num_heads, self.head_dim), query_rotation)
        k = ops.matmul(self.k_proj(x).reshape(batch * seq, self.num_kv_heads, self.head_dim), key_rotation)
        q = q.reshape(batch, seq, self.num_heads, self.head_dim).swapaxes(1, 2)  # [B, H, n, D]
        k = k.reshape(batch, seq, self.num_kv_heads, self.head_dim).swapaxes(1, 2)  # [B, H_kv, n, D]
        v = self.v_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim).swapaxes(1, 2)
        # The views alias the Parameters, which the graph does not know: depend() orders the reads after the writes.
        keys = ops.depend(keys, _write_rows(flat_keys, rows, k))
        values = ops.depend(values, _write_rows(flat_values, rows, v))
        out = cached_attention(q, keys, values, visible)  # [B, H, n, D]
        return self.o_proj(out.swapaxes(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class SwiGLU(nn.Cell):
    """down(silu(gate(x)) * up(x)), `inner` wide (params.ffn_hidden_size by default)."""

    def __init__(self, params: ModelParams, output_std: float, inner: int | None = None):
        super().__init__()
        inner = inner or params.ffn_hidden_size
        self.gate_proj = Linear(params.hidden_size, inner, params.init_std)
        self.up_proj = Linear(params.hidden_size, inner, params.init_std)
        self.down_proj = Linear(inner, params.hidden_size, output_std)
        self.swiglu = SwiGLUFunction()
        self.after = After()

    def construct(self, x: Tensor) -> Tensor:
        # Gate's backward after up's: each projection's backward holds its weight's fp32 cast and fp32 gradient on
        # the CPU, and run side by side the two would hold both pairs at once.
        gate, x = self.after(self.gate_proj(x), x)
        return self.down_proj(self.swiglu(gate, self.up_proj(x)))

    def construct_cached(self, x: Tensor) -> Tensor:
        """`construct` for decoding: silu(gate) * up as Sigmoid and one Addcmul, a kernel fewer than the training path's
        form, which is shaped for its backward."""
        gate = self.gate_proj(x)
        return self.down_proj(_addcmul(_ZERO.astype(gate.dtype), gate, self.up_proj(x), ops.sigmoid(gate)))


class Block(nn.Cell):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). A mixture-of-experts block
    (`is_moe`) returns its routing statistics beside x (see `model_core.model.moe`)."""

    def __init__(self, params: ModelParams, is_moe: bool = False, moe_index: int = -1):
        """`moe_index`: an MoE block's place among the model's MoE blocks (which router noise it takes)."""
        super().__init__()
        # Each residual branch's output projection is scaled down so the stream's variance stays O(1) in depth.
        output_std = params.init_std / math.sqrt(2 * params.num_layers)
        self.is_moe, self.moe_index = is_moe, moe_index
        self.input_layernorm = RMSNorm(params.hidden_size, params.norm_eps)
        self.self_attn = SelfAttention(params, output_std)
        self.post_attention_layernorm = RMSNorm(params.hidden_size, params.norm_eps)
        self.mlp = MoE(params, output_std, SwiGLU) if is_moe else SwiGLU(params, output_std)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, router_noise: Tensor | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        if self.is_moe:
            out, routing = self.mlp(self.post_attention_layernorm(x), router_noise)
            return x + out, routing
        return x + self.mlp(self.post_attention_layernorm(x))

    def construct_cached(self, x, rotations, visible, cache, rows):
        """`construct` for new tokens only, through this layer's KV cache (see `SelfAttention.construct_cached`)."""
        x = x + self.self_attn.construct_cached(self.input_layernorm.construct_cached(x), rotations, visible, cache, rows)
        if self.is_moe:
            return x + self.mlp(self.post_attention_layernorm.construct_cached(x))[0]
        return x + self.mlp.construct_cached(self.post_attention_layernorm.construct_cached(x))


@dataclass
class KVCache:
    """Keys (after RoPE) and values of every layer for slots [0, length) of a batch of sequences.

    The tensors are Parameters that `Llama.decode` writes in place, one slot per position column, so a step
    costs the same whatever the length. A row of `padding[b]` left-padding slots starts its sequence at slot
    padding[b], at position 0: rows of different lengths decode together, each as it would alone. Slots a row
    may not see (its padding, and those from `length` on) hold zeros or stale values that no query reads.
    """

    keys: tuple[Parameter, ...]  # num_layers x [B * H_kv * slots, head_dim], row (b * H_kv + h) * slots + s
    values: tuple[Parameter, ...]  # the same shapes; compute dtype
    # The keys then the values as [B, H_kv, slots, head_dim] views of the same memory, for reading: reshaping a
    # Parameter inside a compiled graph copies it.
    views: tuple[Tensor, ...]
    padding: Tensor  # [B] int32
    length: int = 0

    @property
    def batch(self) -> int:
        return self.padding.shape[0]

    @property
    def slots(self) -> int:
        return self.views[0].shape[2]


class Llama(nn.Cell):
    """tokens [B, T] -> next-token logits [B, T, vocab] (fp32), T <= params.seq_len.

    With `position_ids` [B, T] RoPE uses those positions instead of 0..T-1; with `segment_ids` [B, T] a
    token attends only to earlier tokens of its own segment (document). `document_positions` makes both.
    """

    def __init__(self, params: ModelParams, compute_dtype: ComputeDtype = "float32"):
        super().__init__()
        self.compute_dtype = _DTYPES[compute_dtype]
        self.tie_embeddings = params.tie_embeddings
        self.embed_tokens = Embedding(params.vocab_size, params.hidden_size, params.init_std)
        moe_layers = params.moe_layers
        self.layers = nn.CellList([
            Block(params, index in moe_layers, moe_layers.index(index) if index in moe_layers else -1)
            for index in range(params.num_layers)
        ])
        self.has_moe = bool(moe_layers)  # of the blocks held: a pipeline stage may hold none
        self.moe_blocks = len(moe_layers)  # of the whole model, which the routing losses are averaged over
        self.norm = RMSNorm(params.hidden_size, params.norm_eps)
        if not params.tie_embeddings:
            self.lm_head = Linear(params.hidden_size, params.vocab_size, params.init_std)
        self.head = LinearFunction()
        self.seq_len = params.seq_len
        # A pipeline stage is this model with the ends it does not hold removed (`parallel.pipeline`): it then
        # takes the previous stage's hidden states instead of tokens, or returns its own instead of logits.
        self.takes_tokens, self.returns_logits = True, True
        self.rope_cos, self.rope_sin = rope_tables(params.head_dim, params.seq_len, params.rope_theta)
        self.attention_mask = CausalMask(params.seq_len)
        self.rotation_basis = rotation_basis(params.head_dim)  # decoding's RoPE, see `rotation_matrices`
        self.vocab_mask = vocab_mask(params) if params.vocab_padding else None
        # Generation's KV-cache Parameters by (batch, slots) (`empty_cache`); a plain dict, so not model weights.
        self._cache_slots: dict[tuple[int, int], tuple[tuple[Parameter, ...], ...]] = {}  # keys, values, views

    def construct(self, tokens: Tensor, position_ids: Tensor | None = None, segment_ids: Tensor | None = None) -> Tensor:
        """`tokens`: [B, T] ids, their rows of the embedding table [B, T, hidden] (looked up by the caller), or
        on a pipeline stage after the first the previous stage's [B, T, hidden]."""
        if self.has_moe:
            return self.routed(tokens, position_ids, segment_ids)[0]
        x, cos, sin, mask = self._inputs(tokens, position_ids, segment_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        if not self.returns_logits:
            return x
        return self._logits(x)

    def routed(self, tokens: Tensor, position_ids: Tensor | None = None, segment_ids: Tensor | None = None,
               router_noise: Tensor | None = None):
        """`construct` of a model with MoE blocks, and their routing statistics: (output, (aux, z, load, dropped))
        with aux and z averaged over the model's MoE blocks, load [MoE blocks held, E] and dropped summed over them.
        A pipeline stage holds some of the blocks: its aux and z are its share of the model's mean (their sum over
        the stages is that mean). `router_noise` [MoE blocks of the model, B, T, hidden]: router jitter factors
        (`model.moe.router_noise`), training only."""
        x, cos, sin, mask = self._inputs(tokens, position_ids, segment_ids)
        aux, z, dropped, loads = 0.0, 0.0, 0.0, ()
        for layer in self.layers:
            if layer.is_moe:
                noise = None if router_noise is None else router_noise[layer.moe_index]
                x, (layer_aux, layer_z, load, layer_dropped) = layer(x, cos, sin, mask, noise)
                aux, z, dropped, loads = aux + layer_aux, z + layer_z, dropped + layer_dropped, loads + (load,)
            else:
                x = layer(x, cos, sin, mask)
        routing = (aux / self.moe_blocks, z / self.moe_blocks, ops.stack(loads), dropped)
        if not self.returns_logits:
            return x, routing
        return self._logits(x), routing

    def _inputs(self, tokens: Tensor, position_ids: Tensor | None, segment_ids: Tensor | None):
        """The first block's input [B, T, hidden] (embedded tokens, or a previous stage's hidden states), RoPE's
        cos and sin and the attention mask."""
        # Attention spans the positions' sequence where they are given: under sequence parallelism a later pipeline
        # stage receives a slice of the hidden states with the positions of the whole sequence.
        seq = tokens.shape[1] if position_ids is None else position_ids.shape[1]
        cos, sin = self._rotary_angles(seq, position_ids)
        mask = self.attention_mask(seq, segment_ids)
        if not self.takes_tokens:
            x = tokens
        elif tokens.ndim == 3:  # rows the training step looked up itself (`AccumulateGradients`)
            x = tokens.astype(self.compute_dtype)
        else:
            x = self.embed_tokens(tokens).astype(self.compute_dtype)
        return x, cos, sin, mask

    def _logits(self, x: Tensor) -> Tensor:
        """Final norm, head and, with a padded vocabulary, the padding rows' logits pushed out of the softmax."""
        return self._head_logits(self.norm(x), self.embed_tokens.weight if self.tie_embeddings else self.lm_head.weight)

    def _head_logits(self, x: Tensor, head: Tensor) -> Tensor:
        """`_logits` after the final norm."""
        logits = self.head(x, head.astype(x.dtype)).astype(ms.float32)
        if self.vocab_mask is not None:
            logits = logits + self.vocab_mask
        return logits

    def _rotary_angles(self, seq: int, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """cos, sin broadcastable to [B, H, T, head_dim], in the compute dtype."""
        if position_ids is None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]  # [T, D]
        else:
            cos = ops.gather(self.rope_cos, position_ids, 0).unsqueeze(1)  # [B, 1, T, D]
            sin = ops.gather(self.rope_sin, position_ids, 0).unsqueeze(1)
        return cos.astype(self.compute_dtype), sin.astype(self.compute_dtype)

    @ms.jit
    def compiled_forward(self, tokens, position_ids=None, segment_ids=None):
        """`construct` compiled once per input shape (evaluation, where shapes repeat), without wrapping the
        model in another Cell (which would rename its parameters)."""
        return self.construct(tokens, position_ids, segment_ids)

    # ------------------------------------------------------------------------------- cached decoding

    def empty_cache(self, batch: int, padding: Sequence[int] | None = None, slots: int | None = None) -> KVCache:
        """A cache of `slots` positions (default params.seq_len) for `batch` sequences with none filled; row b's
        sequence starts at slot padding[b] (0). Attention reads every slot at every step, so a cache sized to the
        generation (prompt + new tokens) costs less per step than one of seq_len slots.

        The model keeps one set of cache Parameters per (batch, slots) and every cache of that size shares it: the
        compiled decode step is specialised to the Parameter objects it is given, so fresh ones would compile it
        again (seconds). Starting a cache therefore ends the previous one of the same size.
        """
        slots = self.seq_len if slots is None else int(slots)
        if not 0 < slots <= self.seq_len:
            raise ValueError(f"a KV cache of slots={slots} must hold 1 to seq_len={self.seq_len} positions")
        padding = [0] * batch if padding is None else [int(count) for count in padding]
        if len(padding) != batch or not all(0 <= count < slots for count in padding):
            raise ValueError(f"padding {padding} must hold {batch} slot counts in [0, slots={slots})")
        if (batch, slots) not in self._cache_slots:
            attention = self.layers[0].self_attn
            shape = (batch * attention.num_kv_heads * slots, attention.head_dim)

            def flat(name: str, layer: int) -> Parameter:
                name = f"kv_cache.{batch}x{slots}.{name}.{layer}"
                return Parameter(ops.zeros(shape, self.compute_dtype), name, requires_grad=False)

            keys = tuple(flat("keys", layer) for layer in range(len(self.layers)))
            values = tuple(flat("values", layer) for layer in range(len(self.layers)))
            views = tuple(param.view(batch, attention.num_kv_heads, slots, -1) for param in keys + values)
            self._cache_slots[batch, slots] = keys, values, views
        keys, values, views = self._cache_slots[batch, slots]
        return KVCache(keys, values, views, Tensor(np.asarray(padding, np.int32)))

    def decode(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """Logits [B, n, vocab] (fp32) of tokens [B, n] in slots [cache.length, cache.length + n), each attending
        to its row's filled slots and to the new tokens up to itself. Writes their keys and values into `cache`
        and advances cache.length.

        The logits of a row equal those of `construct` on its sequence alone (up to float summation order).
        """
        batch, new = tokens.shape
        if cache.batch != batch:
            raise ValueError(f"tokens hold {batch} sequences but the KV cache was made for {cache.batch}")
        if cache.length + new > cache.slots:
            raise ValueError(f"{new} new tokens after {cache.length} cached positions exceed the cache's {cache.slots} slots")
        head = self.embed_tokens.weight if self.tie_embeddings else self.lm_head.weight
        # The head enters as a view: a graph with writes that reads one Parameter twice (the tied table: embedding and
        # head) copies it, 16 MB a step on the reference model.
        start = Tensor(cache.length, ms.int32)
        logits = self._decode(tokens, start, cache.padding, head.view(head.shape), *cache.views, *cache.keys, *cache.values)
        cache.length += new
        return logits

    @ms.jit
    def _decode(self, tokens, start, padding, head, *caches):
        """`decode` as one compiled graph per (batch, number of new tokens, cache slots); `start` is an int32 scalar
        Tensor. `caches` (a tuple argument of them is not accepted): the `KVCache.views` to read, keys of every
        layer then values, then the flat Parameters to write, keys then values."""
        batch, new = tokens.shape
        layers = len(self.layers)
        heads, slots = caches[0].shape[1], caches[0].shape[2]
        new_slots = ops.arange(new, dtype=ms.int32) + start  # [n]
        positions = mint.clamp(new_slots.reshape(1, -1) - padding.reshape(-1, 1), 0, self.seq_len - 1)  # [B, n]
        columns = ops.arange(slots, dtype=ms.int32).reshape(1, 1, -1)  # [1, 1, S]
        causal = columns <= new_slots.reshape(1, -1, 1)  # [1, n, S]
        visible = mint.logical_and(causal, columns >= padding.reshape(-1, 1, 1)).unsqueeze(1)  # [B, 1, n, S]
        flat_positions = positions.reshape(-1)
        cos, sin = ops.gather(self.rope_cos, flat_positions, 0), ops.gather(self.rope_sin, flat_positions, 0)  # [B * n, D]
        key_rotation = rotation_matrices(cos, sign_first_half(sin), self.rotation_basis)  # [B * n, D, D]
        rotations = ((key_rotation * (1.0 / math.sqrt(cos.shape[-1]))).astype(self.compute_dtype),
                     key_rotation.astype(self.compute_dtype))
        sequence = ops.arange(batch * heads, dtype=ms.int32).reshape(batch, heads, 1)  # b * H_kv + h
        rows = sequence * slots + new_slots.reshape(1, 1, -1)  # [B, H_kv, n]: the new slots' rows of the flat caches
        x = self.embed_tokens(tokens).astype(self.compute_dtype)  # [B, n, hidden]
        for i in range(layers):
            cache = (caches[i], caches[layers + i], caches[2 * layers + i], caches[3 * layers + i])
            x = self.layers[i].construct_cached(x, rotations, visible, cache, rows)
        return self._head_logits(self.norm.construct_cached(x), head)


# In place on a Parameter, along its first axis: only the new rows are written. (ScatterNdUpdate, which could
# index [B, H_kv, S, D] directly, copies the whole cache on CPU: ~2 ms a layer at batch 8.)
_write_rows = ops.ScatterUpdate()


# Added to a padding row's logit: exp() of it is exactly 0 in fp32 next to any real logit, so the softmax, the
# loss and its gradient are those of the unpadded vocabulary, and the padding rows get no gradient.
PADDING_LOGIT = -1e9


def vocab_mask(params: ModelParams) -> Tensor:
    """[vocab] fp32: 0 for the tokenizer's ids, `PADDING_LOGIT` for the padding rows after them."""
    mask = np.zeros(params.vocab_size, np.float32)
    mask[params.unpadded_vocab_size :] = PADDING_LOGIT
    return Tensor(mask)


def count_parameters(model: nn.Cell, include_embeddings: bool = True) -> int:
    """Number of parameter elements; without embeddings, the token-embedding table is left out.

    The lookup costs no FLOPs, so MFU counts N without it. An untied `lm_head` is a matmul and is always
    counted; a tied head shares the embedding table and leaves with it.
    """
    return sum(
        param.size
        for param in model.get_parameters()
        if include_embeddings or not param.name.endswith("embed_tokens.weight")
    )
