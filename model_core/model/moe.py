"""A sparse mixture-of-experts feed-forward block (Mixtral's): router, top-k softmax gating, SwiGLU experts.

Every token's router logits (a linear map of its hidden state, fp32) give a softmax over the E experts; the
token goes to its k most probable experts, and its output is their outputs weighted by those probabilities
(renormalised to sum to 1 when `normalize_top_k`, as Mixtral does). With sigmoid gating (DeepSeek-V3's) each
expert's score is sigmoid(logit) on its own, the top k scores choose and weigh the experts (renormalised the
same way), and the balancing loss reads each token's scores normalised to sum to 1 as its probabilities.

Dispatch has static shapes, so the step compiles once: each expert has `capacity` slots per micro-batch, the
token choices fill them first choices first, in token order within each rank of choice, and an expert's
slots run as one batched SwiGLU over [E, capacity, hidden]. Dropless routing (capacity_factor null) gives
every expert as many slots as there are tokens, so nothing is ever dropped, at the price of computing E/k
times the active FFN FLOPs on slots that mostly hold nothing; a capacity factor bounds that work and drops
the choices past an expert's capacity (their weight is lost; the token keeps its residual).

Dispatch and combine have hand-written backwards (`Dispatch`, `Combine`) that gather where the derived ones
scatter-add: a slot holds at most one choice, so a slot's gradient is one token's gradient times one gate, and a
token's is the sum of its k choices' slot gradients. With them, experts whose weights are multiplied without
transposed copies (`BatchMatMul(transpose_b=True)`) and the SwiGLU of `model_core.model.fused`, the layer's step
takes less CPU time than with the derived backwards (benchmarks/README.md, "Mixture-of-experts layer").

Router jitter (Switch Transformer's, `router_jitter`) multiplies the router's input element-wise by noise drawn
from uniform [1 - eps, 1 + eps] in training; the experts see the token as it is (Hugging Face Mixtral jitters
their input too). The block draws nothing itself: the trainer passes the noise in (`router_noise`), drawn from
a key of the run's seed, the optimizer step and the row's place in the step's global batch, so a resumed run
and every layout draw the same; evaluation and generation pass none.

An optional shared expert (DeepSeek-MoE, Qwen2-MoE) is a plain SwiGLU every token goes through, added to the
routed output, scaled by sigmoid(w . x) when `shared_expert_gate` (Qwen2-MoE's [1, hidden] gate).

Expert weights are stacked: `experts.gate_proj` [E, F, hidden], `experts.up_proj` [E, F, hidden],
`experts.down_proj` [E, hidden, F], each expert's slice laid out like a dense SwiGLU's [out, in] weight. The
block only ever calls `experts` on the whole [E, C, hidden] dispatch buffer, so expert parallelism can swap that
cell from outside (`model_core.parallel.expert`) and the routing stays as written here.

Routing statistics come back beside the output for the training objective and the metrics:
  aux    Switch Transformer's load-balancing loss E * sum_e f_e * P_e, f_e the fraction of the k * N token
         choices that picked expert e (before any drop) and P_e the mean router probability of e; 1 when
         balanced, E when every token picks one expert;
  z      ST-MoE's router z-loss, mean over tokens of logsumexp(router logits)^2;
  load   [E] choices each expert was picked for (before drops), and `dropped`, the choices past capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

from model_core.model.fused import SwiGLUFunction, expand_rows
from model_core.model.init import new_weight
from params.schema import ModelParams


class Router(nn.Cell):
    """hidden [N, hidden] -> router logits [N, E] in fp32 (`weight` [E, hidden], Mixtral's `gate`)."""

    def __init__(self, hidden_size: int, num_experts: int, init_std: float):
        super().__init__()
        self.weight = new_weight((num_experts, hidden_size), init_std)

    def construct(self, x: Tensor) -> Tensor:
        return mint.matmul(x, self.weight.astype(x.dtype).T).astype(ms.float32)


class Experts(nn.Cell):
    """E SwiGLU experts applied slot-wise: [E, C, hidden] -> [E, C, hidden]."""

    def __init__(self, params: ModelParams, output_std: float):
        super().__init__()
        experts, hidden, inner = params.moe.num_experts, params.hidden_size, params.expert_ffn_hidden_size
        self.gate_proj = new_weight((experts, inner, hidden), params.init_std)
        self.up_proj = new_weight((experts, inner, hidden), params.init_std)
        self.down_proj = new_weight((experts, hidden, inner), output_std)
        self.swiglu = SwiGLUFunction()

    def construct(self, x: Tensor) -> Tensor:
        return swiglu_experts(x, self.gate_proj, self.up_proj, self.down_proj, self.swiglu)


_bmm_nt = ops.BatchMatMul(transpose_b=True)  # x @ w^T per expert, and its backward, without transposed copies


def swiglu_experts(x: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor, swiglu: nn.Cell) -> Tensor:
    """Expert e's SwiGLU on its slots: x [E, C, hidden], weights [E, F, hidden] (down [E, hidden, F]) -> [E, C, hidden].
    `swiglu`: a `SwiGLUFunction`."""
    gate = _bmm_nt(x, gate_proj.astype(x.dtype))  # [E, C, F]
    up = _bmm_nt(x, up_proj.astype(x.dtype))
    return _bmm_nt(swiglu(gate, up), down_proj.astype(x.dtype))


def sum_choices(rows: Tensor, k: int) -> Tensor:
    """[k * N, hidden] rows, choice j of token n at row j * N + n -> [N, hidden], each token's k rows summed."""
    return rows.reshape(k, -1, rows.shape[-1]).sum(0)


class Dispatch(nn.Cell):
    """flat [N, hidden] -> the dispatch buffer [S, hidden], slot s holding token filler[s].

    The backward gathers instead of scattering: token n's gradient is the sum of its kept choices' slot gradients
    (`slot` [kN], `kept` [kN] 1.0 or 0.0), because each slot holds at most one choice."""

    def construct(self, flat, filler, slot, kept):
        return ops.gather(flat, filler, 0)

    def bprop(self, flat, filler, slot, kept, out, dout):
        back = ops.gather(dout, slot, 0)  # [kN, hidden]
        dflat = sum_choices(back * expand_rows(kept, back), slot.shape[0] // flat.shape[0])
        return dflat, ops.zeros_like(filler), ops.zeros_like(slot), ops.zeros_like(kept)


class Combine(nn.Cell):
    """done [S, hidden] (the experts' outputs by slot) -> [N, hidden], each token's choices' outputs weighted by
    `gate` [kN] (0 for a dropped choice, whose `slot` may then be any slot) and summed.

    The backward gathers instead of scattering, as `Dispatch` does: slot s's gradient is the gradient of the token
    filling it (`filler` [S]) times that choice's gate (`slot_gate` [S], 0 for an empty slot)."""

    def __init__(self, top_k: int):
        super().__init__()
        self.top_k = top_k

    def construct(self, done, slot, gate, filler, slot_gate):
        picked = ops.gather(done, slot, 0)  # [kN, hidden]
        return sum_choices(picked * expand_rows(gate, picked), self.top_k)

    def bprop(self, done, slot, gate, filler, slot_gate, out, dout):
        k = self.top_k
        ddone = ops.gather(dout, filler, 0)
        ddone = ddone * expand_rows(slot_gate, ddone)
        dgate = mint.sum(ops.gather(done, slot, 0) * mint.cat((dout,) * k), dim=-1)
        return ddone, ops.zeros_like(slot), dgate, ops.zeros_like(filler), ops.zeros_like(slot_gate)


ROUTER_NOISE_STREAM = 0x6A6974  # "jit": keeps these draws apart from any other generator keyed by the seed


def router_noise(eps: float, seed: int, step: int, rows: Sequence[int], blocks: int, seq: int, hidden: int) -> np.ndarray:
    """Router jitter factors [blocks, len(rows), seq, hidden] fp32, uniform in [1 - eps, 1 + eps]: row r of the
    micro-batch is row `rows[r]` of optimizer step `step`'s global batch, and its noise comes from its own
    generator keyed (seed, step, that row), so it does not depend on which rank or micro-batch holds the row."""
    noise = np.empty((blocks, len(rows), seq, hidden), np.float32)
    for r, row in enumerate(rows):
        generator = np.random.default_rng([seed, step, row, ROUTER_NOISE_STREAM])
        noise[:, r] = generator.uniform(1.0 - eps, 1.0 + eps, (blocks, seq, hidden))
    return noise


class MoE(nn.Cell):
    """x [B, T, hidden] -> (y [B, T, hidden], (aux, z, load [E], dropped)); see the module docstring. `noise`
    [B, T, hidden], when given, multiplies the router's input (router jitter, training only).

    `dense` is the block class of a plain SwiGLU (the model's own, passed in to keep this module below it),
    used for the shared expert when there is one."""

    def __init__(self, params: ModelParams, output_std: float, dense: type | None = None):
        super().__init__()
        moe = params.moe
        self.params = params
        self.num_experts, self.top_k = moe.num_experts, moe.experts_per_token
        self.normalize_top_k = moe.normalize_top_k
        self.sigmoid_gating = moe.gating == "sigmoid"
        self.router = Router(params.hidden_size, self.num_experts, params.init_std)
        self.experts = Experts(params, output_std)
        self.dispatch, self.combine = Dispatch(), Combine(self.top_k)
        self.has_shared_expert = moe.shared_expert_ffn_hidden_size is not None
        self.has_shared_gate = self.has_shared_expert and moe.shared_expert_gate
        if self.has_shared_expert:
            self.shared_expert = dense(params, output_std, moe.shared_expert_ffn_hidden_size)
        if self.has_shared_gate:
            self.shared_expert_gate = Router(params.hidden_size, 1, params.init_std)

    def construct(self, x: Tensor, noise: Tensor | None = None):
        batch, seq, hidden = x.shape
        tokens, experts, k = batch * seq, self.num_experts, self.top_k
        slots = self.params.moe.capacity(tokens)
        flat = x.reshape(tokens, hidden)
        if noise is None:
            logits = self.router(flat)  # [N, E] fp32
        else:
            logits = self.router(flat * noise.reshape(tokens, hidden).astype(flat.dtype))
        if self.sigmoid_gating:
            scores = mint.sigmoid(logits)  # each expert's affinity on its own
            probs = scores / scores.sum(-1, keepdims=True)  # the shares the balancing loss averages
        else:
            scores = probs = mint.softmax(logits, -1)
        weights, chosen = ops.topk(scores, k)  # [N, k]
        if self.normalize_top_k:
            weights = weights / weights.sum(-1, keepdims=True)
        # Choice j of token n sits at row j * N + n: first choices fill the slots before any second choice.
        choice = chosen.T.reshape(-1)  # [kN]
        picked = ops.one_hot(choice, experts, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))  # [kN, E]
        position = ((ops.cumsum(picked, 0) - 1.0) * picked).sum(-1).astype(ms.int32)  # its place in its expert's queue
        kept = position < slots
        keep = kept.astype(ms.float32)
        trash = experts * slots  # one extra slot that dropped choices are written to; it is cut off below
        slot = mint.where(kept, choice * slots + position, ops.ones_like(position) * trash)  # [kN]
        token = ops.arange(k * tokens, dtype=ms.int32) % tokens
        gate = (weights.T.reshape(-1) * keep).astype(x.dtype)  # [kN]
        # Which token fills each slot, and with what weight. An empty slot holds token 0 at weight 0: its output
        # is never read, and its gradient is zero.
        filler = ops.tensor_scatter_update(ops.zeros((trash + 1,), ms.int32), slot.reshape(-1, 1), token)[:trash]
        slot_gate = ops.tensor_scatter_update(
            ops.zeros((trash + 1,), x.dtype), slot.reshape(-1, 1), ops.stop_gradient(gate))[:trash]
        slot = slot % trash  # a dropped choice reads slot 0 at weight 0
        dispatched = self.dispatch(flat, filler, slot, keep.astype(x.dtype)).reshape(experts, slots, hidden)
        done = self.experts(dispatched).reshape(trash, hidden)
        combined = self.combine(done, slot, gate, filler, slot_gate)
        if self.has_shared_expert:
            shared = self.shared_expert(flat)
            if self.has_shared_gate:
                shared = shared * mint.sigmoid(self.shared_expert_gate(flat)).astype(shared.dtype)
            combined = combined + shared
        load = picked.sum(0)  # [E]
        aux = experts * (load / (k * tokens) * probs.mean(0)).sum()
        z = (ops.logsumexp(logits, -1) ** 2).mean()
        dropped = (1.0 - kept.astype(ms.float32)).sum()
        return combined.reshape(batch, seq, hidden), (aux, z, load, dropped)
