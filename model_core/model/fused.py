"""Layers with hand-written backward passes (`nn.Cell.bprop`), for the places where MindSpore's automatic
differentiation is slow or memory-hungry on CPU.

Measured on MindSpore 2.10 (CPU, jit): the derived backward of `ops.cross_entropy` held about 16 logits-sized
buffers and differentiated through its max-subtraction; RMSNorm's held about 13 activation-sized buffers;
`masked_fill` + softmax about 10 score-sized ones; `mint.nn.functional.linear` transposed its gradient
explicitly. The graph keeps what a backward pass needs for the whole step, so every buffer counts. Each Cell
below computes exactly the textbook gradient from its inputs (and, for attention, its [B, H, T, D] output),
keeps nothing else, and recomputes the cheap parts (the softmax of the scores, the softmax of the logits)
instead of storing them.

A second CPU trap shapes the code: an elementwise op whose operands broadcast (x * w with w [D], x - m
with m [N, 1]) keeps two int64 index arrays of the output's size alive for the life of the compiled graph,
16 bytes per element, per op. `expand` materialises the small
operand first, which costs one write and keeps nothing; `expand_rows` and `expand_leading` do the common
patterns as matmuls, which the CPU runs faster than the BroadcastTo kernel. A scalar operand is free either
way. The Transpose kernel does the same (8 bytes per element), so the head axis is moved by a Gather of rows
(`HeadsFirst`, `HeadsLast`) rather than by swapaxes.

The forward of every Cell is the same arithmetic as the plain formulation; tests compare both directions.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import mint, nn, ops

_matmul = ops.MatMul()
_matmul_nt = ops.MatMul(transpose_b=True)  # a @ b^T
_matmul_tn = ops.MatMul(transpose_a=True)  # a^T @ b
_bmm_nt = ops.BatchMatMul(transpose_b=True)
_bmm_tn = ops.BatchMatMul(transpose_a=True)


def expand(small, like):
    """`small` broadcast to the shape of `like`, as a real tensor (see the module docstring for why)."""
    return small.broadcast_to(like.shape)


def expand_rows(column, like):
    """`column` [..., 1] repeated along the last axis of `like` [..., D]: `expand` as an outer product with a row of
    ones, a matmul with one term per element (so exact) that the CPU runs faster than the BroadcastTo kernel
    (benchmarks/README.md, "Train step").
    """
    ones = ops.ones((1, like.shape[-1]), column.dtype)
    return _matmul(column.reshape(-1, 1), ones).reshape(like.shape)


def expand_leading(small, like):
    """`small`, the trailing shape of `like`, repeated over its leading axes (w [D] -> [N, D]), as `expand_rows`
    does it."""
    ones = ops.ones((like.size // small.size, 1), small.dtype)
    return _matmul(ones, small.reshape(1, -1)).reshape(like.shape)


def row_sum(x):
    """Sum over the last axis, kept as a size-1 axis. Reduced as a 2-D view: the CPU kernels reduce the last axis
    of a 3-D or 4-D tensor far slower than of its 2-D view (benchmarks/README.md, "Train step")."""
    return mint.sum(x.reshape(-1, x.shape[-1]), dim=-1, keepdim=True).reshape(x.shape[:-1] + (1,))


class LinearFunction(nn.Cell):
    """y = x W^T for x [..., in], W [out, in]; the backward uses transposed-operand matmuls, no copies.

    A low-precision matmul on CPU is computed as the fp32 matmul of its operands cast to fp32, its result cast back,
    which is what the CPU's float16 kernel computes (the same bits), but in casts the graph frees after the matmul:
    the kernel itself keeps its fp32 copy of every weight it reads for the life of the compiled graph, a fp32 copy
    of every matmul weight in the forward and another in the backward. Each cast of the weight waits for the matmul's
    other operand (x, dout): a compiled graph runs an op as soon as its inputs exist, so a cast of a Parameter
    alone would run at the start of the graph, all of them at once, and the backward's would be merged with the
    forward's and kept from one pass to the other (benchmarks/README.md, "Model states against the ZeRO paper")."""

    def __init__(self) -> None:
        super().__init__()
        self.upcast = ms.get_context("device_target") == "CPU"  # elsewhere low-precision matmuls run natively

    def construct(self, x, weight):
        out_features, in_features = weight.shape
        x_2d = x.reshape(-1, in_features)
        if self.upcast and x.dtype != ms.float32:
            y = _matmul_nt(x_2d.astype(ms.float32), ops.depend(weight, x).astype(ms.float32)).astype(x.dtype)
        else:
            y = _matmul_nt(x_2d, weight)
        return y.reshape(x.shape[:-1] + (out_features,))

    def bprop(self, x, weight, out, dout):
        out_features, in_features = weight.shape
        dout_2d = dout.reshape(-1, out_features)
        x_2d = x.reshape(-1, in_features)
        if self.upcast and dout.dtype != ms.float32:
            dout_32 = dout_2d.astype(ms.float32)
            dx = ops.matmul(dout_32, ops.depend(weight, dout).astype(ms.float32)).astype(x.dtype).reshape(x.shape)
            dweight = _matmul_tn(dout_32, x_2d.astype(ms.float32)).astype(weight.dtype)
            return dx, dweight
        dx = ops.matmul(dout_2d, weight).reshape(x.shape)
        dweight = _matmul_tn(dout_2d, x_2d)
        return dx, dweight


class RMSNormFunction(nn.Cell):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, all in the dtype of x (callers pass fp32).

    The backward reduces dout * x twice by matmul, against each row's r = 1 / rms(x) for the weight's gradient
    and against the weight for each row's sum(g * x) with g = dout * weight; and it scales dout by the outer
    product r weight^T, one matmul with one term per element, instead of broadcasting r and weight in two passes
    (3 Muls over the shape of x instead of 5).
    """

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps
        # fp64 matmuls are a CPU trick (below); Ascend's matmul units have no fp64, so elsewhere the mean kernel runs.
        self.fp64_matmul_mean = ms.get_context("device_target") == "CPU"

    def construct(self, x, weight):
        return x * expand_rows(self._inverse_rms(x), x) * expand_leading(weight, x)

    def bprop(self, x, weight, out, dout):
        size = x.shape[-1]
        inverse_rms = self._inverse_rms(x)  # [N, 1]
        dout_x = (dout * x).reshape(-1, size)
        dweight = _matmul_tn(inverse_rms, dout_x).reshape(size)
        # dx = r g - x r^3 mean(g * x): the second term's per-row factor is a column, expanded once.
        correction = inverse_rms * inverse_rms * inverse_rms * _matmul(dout_x, weight.reshape(size, 1)) / size
        scale = _matmul(inverse_rms, weight.reshape(1, size)).reshape(x.shape)
        dx = dout * scale - x * expand_rows(correction, x)
        return dx, dweight

    def _inverse_rms(self, x):
        """1 / rms(x) per row, [N, 1] for x viewed as [N, D]."""
        # The mean kernel over the last axis of a 3-D tensor sums in fp64: its means are the fp64 sums of the fp32
        # squares, rounded, and training depends on those last bits (tests/test_trainer.py's accumulation test
        # failed with a 2-D fp32 row sum). A fp64 matmul with a column of ones gives the same bits, the cast
        # included, in about 1 ms against 2-4 ms for that kernel (measured on [8, 256, 512]).
        squares = (x * x).reshape(-1, x.shape[-1])
        if self.fp64_matmul_mean:
            sums = _matmul(squares.astype(ms.float64), ops.ones((x.shape[-1], 1), ms.float64))
            means = (sums / x.shape[-1]).astype(x.dtype)
        else:
            means = mint.mean(squares, dim=-1, keepdim=True)
        return mint.rsqrt(means + self.eps)


def heads_first(x):
    """[B, T, H, D] -> [B, H, T, D], one Gather of rows."""
    batch, seq, heads, head_dim = x.shape
    return _swap_middle_axes(x.reshape(batch, seq * heads, head_dim), seq, heads).reshape(batch, heads, seq, head_dim)


def heads_last(x):
    """[B, H, T, D] -> [B, T, H, D], one Gather of rows."""
    batch, heads, seq, head_dim = x.shape
    return _swap_middle_axes(x.reshape(batch, heads * seq, head_dim), heads, seq).reshape(batch, seq, heads, head_dim)


def _swap_middle_axes(x, outer, inner):
    """x [B, outer * inner, D] with its middle axis read as [outer, inner] and written as [inner, outer].

    One Gather kernel instead of a slice per head and a Concat: fewer launches and less time in a profiled train
    step (benchmarks/README.md, "Train step").
    """
    # A numpy constant: jit folds it into the graph (ops.arange fails to compile when first parsed in a bprop).
    rows = np.arange(outer, dtype=np.int32).reshape(1, outer) * inner + np.arange(inner, dtype=np.int32).reshape(inner, 1)
    return ops.gather(x, ms.Tensor(rows.reshape(-1)), 1)


class HeadsFirst(nn.Cell):
    """`heads_first`, whose gradient is `heads_last` of dout."""

    def construct(self, x):
        return heads_first(x)

    def bprop(self, x, out, dout):
        return (heads_last(dout),)


class HeadsLast(nn.Cell):
    """`heads_last`, whose gradient is `heads_first` of dout."""

    def construct(self, x):
        return heads_last(x)

    def bprop(self, x, out, dout):
        return (heads_first(dout),)


def apply_rotary(x, cos, sin):
    """RoPE: rotate each (x[i], x[i + D/2]) pair by its angle. x: [B, H, T, D]; cos, sin broadcast to it."""
    return x * expand(cos, x) + _swap_halves(x) * expand(sign_first_half(sin), x)


def _swap_halves(x):
    """[x[D/2:], x[:D/2]] over the last axis: rotate_half without its minus sign, which `sign_first_half` moves
    onto the [T, D] sine table (one Neg of the table per step instead of one per rotated [B, H, T, D] tensor)."""
    half = x.shape[-1] // 2
    return mint.cat((x[..., half:], x[..., :half]), dim=-1)


def sign_first_half(sin):
    """sin with its first half negated, so that rotate_half(x) * sin == _swap_halves(x) * it, bit for bit."""
    half = sin.shape[-1] // 2
    return mint.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class RotaryFunction(nn.Cell):
    """`apply_rotary`. The map is a rotation, so its gradient is the inverse rotation of dout."""

    def construct(self, x, cos, sin):
        return apply_rotary(x, cos, sin)

    def bprop(self, x, cos, sin, out, dout):
        # rotate_half^T(dout * sin) = _swap_halves(dout * sin with its first half negated)
        dx = dout * expand(cos, dout) + _swap_halves(dout * expand(sign_first_half(sin), dout))
        return dx, ops.zeros_like(cos), ops.zeros_like(sin)


class After(nn.Cell):
    """(earlier, x once `earlier` exists); in the backward, `earlier`'s gradient once x's exists.

    An ordering, not a computation: what computes `earlier` runs its forward before, and its backward after, what
    reads the x returned, where a compiled graph would run the two side by side."""

    def construct(self, earlier, x):
        return earlier, ops.depend(x, earlier)

    def bprop(self, earlier, x, out, dout):
        d_earlier, d_x = dout
        return ops.depend(d_earlier, d_x), d_x


class SwiGLUFunction(nn.Cell):
    """silu(gate) * up, keeping its two inputs and sigmoid(gate), gate * sigmoid(gate) for the backward.

    The forward spells silu out (the same bits as mint's silu) so that jit merges the backward's sigmoid and
    product with the forward's: one Sigmoid and one Mul over [B, T, ffn] less per layer (8 of 16 Sigmoids a step
    left on the reference model), for those two tensors kept between the passes (their RSS: benchmarks/README.md,
    "Train step").
    """

    def construct(self, gate, up):
        return gate * ops.sigmoid(gate) * up

    def bprop(self, gate, up, out, dout):
        sigmoid = ops.sigmoid(gate)
        silu = gate * sigmoid
        dgate = dout * up * (sigmoid + silu * (1.0 - sigmoid))  # d silu / d gate = s + gate s (1 - s)
        return dgate, dout * silu


# The most fp32 score elements ([B, H, rows, S]) one query block of `SoftmaxAttentionFunction` computes at once,
# and the fewest query rows a block has (which bounds how many blocks a long sequence unrolls into).
QUERY_BLOCK_SCORES = 2**22
MIN_QUERY_BLOCK_ROWS = 64
_MASKED_SCORE = float(np.finfo(np.float32).min)


def query_block_rows(batch: int, heads: int, keys: int, queries: int) -> int:
    """Query rows per block of `SoftmaxAttentionFunction`: as many as keep a block's scores within
    QUERY_BLOCK_SCORES elements, at least MIN_QUERY_BLOCK_ROWS, at most all `queries`. (Conditionals rather than
    min/max: the graph compiler parses this.)"""
    rows = QUERY_BLOCK_SCORES // (batch * heads * keys)
    if rows < MIN_QUERY_BLOCK_ROWS:
        rows = MIN_QUERY_BLOCK_ROWS
    if rows > queries:
        rows = queries
    return rows


class SoftmaxAttentionFunction(nn.Cell):
    """softmax(q k^T * scale where mask, else -inf) v, the probabilities in fp32. q: [B, H, T, D]; k, v:
    [B, H, S, D]; mask: bool, True where a query may attend to a key, [T, S] or [B, 1, T, S].

    Memory-efficient attention for backends without a fused kernel, as flash attention is where one exists. The
    queries are taken in blocks of `query_block_rows`: each block's softmax runs over all keys, so it is exact (no
    online softmax), and only one block's [B, H, rows, S] scores exist at a time instead of the whole [B, H, T, S].
    The backward recomputes each block's probabilities from q and k (nothing score-sized is kept between the
    passes), writes that block's dq and adds its share to dk and dv. The mask goes in as the boolean it is (a
    quarter of an fp32 bias's bytes, one tensor shared by every layer) and each block turns its rows into the
    additive bias. The scale is applied to the [B, H, rows, D] queries, never to the scores.
    """

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def construct(self, q, k, v, mask):
        outputs = []
        for start, stop in self._blocks(q, k):
            q_block, mask_block = _query_rows(q, start, stop), _query_rows(mask, start, stop)
            if outputs:  # one block's scores at a time: each starts once the previous one's output exists
                q_block, mask_block = ops.depend(q_block, outputs[-1]), ops.depend(mask_block, outputs[-1])
            probs = self._probabilities(q_block, k, mask_block)
            outputs.append(ops.matmul(probs.astype(v.dtype), v))
        return outputs[0] if len(outputs) == 1 else mint.cat(outputs, dim=2)

    def bprop(self, q, k, v, mask, out, dout):
        # Softmax backward: dscores = probs * (dprobs - rowsum(dprobs * probs)) with dprobs = dout v^T. The row
        # sum equals rowsum(dout * out) (out = probs v), a sum over D instead of S; and appending it as one more
        # column ([dout, -sum] [v, 1]^T = dprobs - sum) subtracts it inside the matmul instead of broadcasting
        # it over the scores. The column of ones has the keys' length, which is not the queries' under context
        # parallelism.
        values = mint.cat((v, ops.ones_like(v[:, :, :, :1])), dim=-1)
        # Tied to dout, the recomputation is no longer the forward's own arithmetic on the same inputs, which the
        # graph compiler would otherwise merge with it (common subexpressions), keeping the forward's
        # probabilities and bias alive until here.
        q, mask = ops.depend(q, dout), ops.depend(mask, dout)
        dq_blocks, dk, dv = [], None, None
        for start, stop in self._blocks(q, k):
            q_block, mask_block = _query_rows(q, start, stop), _query_rows(mask, start, stop)
            dout_block, out_block = _query_rows(dout, start, stop), _query_rows(out, start, stop)
            if dq_blocks:  # the blocks are independent: without these edges the compiler may run them side by side
                done = (dq_blocks[-1], dk, dv)
                q_block, mask_block = ops.depend(q_block, done), ops.depend(mask_block, done)
            probs = self._probabilities(q_block, k, mask_block)
            row = row_sum(dout_block.astype(ms.float32) * out_block.astype(ms.float32)).astype(dout.dtype) * self.scale
            shifted = _bmm_nt(mint.cat((dout_block * self.scale, -row), dim=-1), values)
            dscores = (probs * shifted.astype(ms.float32)).astype(q.dtype)
            dv_block, dk_block = _bmm_tn(probs.astype(v.dtype), dout_block), _bmm_tn(dscores, q_block)
            dv = dv_block if dv is None else dv + dv_block
            dk = dk_block if dk is None else dk + dk_block
            dq_blocks.append(ops.matmul(dscores, k))
        dq = dq_blocks[0] if len(dq_blocks) == 1 else mint.cat(dq_blocks, dim=2)
        return dq, dk, dv, ops.zeros_like(mask)

    def _blocks(self, q, k):
        batch, heads, queries, _ = q.shape
        rows = query_block_rows(batch, heads, k.shape[2], queries)
        blocks = []
        for start in range(0, queries, rows):
            stop = start + rows
            blocks.append((start, stop if stop < queries else queries))
        return blocks

    def _probabilities(self, q, k, mask):
        scores = _bmm_nt(q * self.scale, k).astype(ms.float32)
        bias = ops.logical_not(mask).astype(ms.float32) * _MASKED_SCORE
        return mint.softmax(scores + expand(bias, scores), dim=-1)


def _query_rows(x, start, stop):
    """Rows start:stop of the query axis (the second last) of q, out, dout [B, H, T, D] or a mask [T, S] or
    [B, 1, T, S]; x itself when they are all of them (a slice would copy it)."""
    if start == 0 and stop == x.shape[-2]:
        return x
    if x.ndim == 2:
        return x[start:stop]
    return x[:, :, start:stop]


class TokenNLLFunction(nn.Cell):
    """Per-row -log softmax(logits)[label] for logits [N, V] fp32 and labels [N] (each a valid class id).

    The fused LogSoftmax and Softmax kernels replace a max, subtraction, exp and sum spelled out over the
    [N, V] logits, each pass of which launched a kernel over all of them (benchmarks/README.md, "Train step").
    """

    def construct(self, logits, labels):
        return -ops.gather_d(ops.log_softmax(logits, -1), 1, labels.reshape(-1, 1)).reshape(-1)

    def bprop(self, logits, labels, out, dout):
        probs = mint.softmax(logits, dim=-1)
        one_hot = ops.one_hot(labels, logits.shape[1], ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32))
        return (probs - one_hot) * expand_rows(dout.reshape(-1, 1), logits), ops.zeros_like(labels)
