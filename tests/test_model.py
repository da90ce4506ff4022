"""The single-device Llama: shapes, causality, RoPE, GQA, document reset, init, head tying, loss, graph
mode, and numerical parity with Hugging Face `LlamaForCausalLM`."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest

from model_core.convert.llama import from_hf
from model_core.model import Attention, Llama, count_parameters, document_positions, fused, token_cross_entropy
from model_core.model.fused import apply_rotary
from model_core.model.llama import RMSNorm, SwiGLU, rope_tables, rotation_basis, rotation_matrices
from params.schema import ModelParams

VOCAB, SEQ = 256, 16


def tiny_params(**overrides) -> ModelParams:
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, seq_len=SEQ
    )
    return ModelParams(**{**fields, **overrides})


def build(seed: int = 0, compute_dtype: str = "float32", **overrides) -> Llama:
    ms.set_seed(seed)
    return Llama(tiny_params(**overrides), compute_dtype)


def random_tokens(batch: int = 2, seq: int = SEQ, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq)).astype(np.int32)


def logits_of(model: Llama, tokens: np.ndarray, position_ids=None, segment_ids=None) -> np.ndarray:
    extra = [ms.Tensor(a) for a in (position_ids, segment_ids) if a is not None]
    return model(ms.Tensor(tokens), *extra).asnumpy()


def weights(model: Llama) -> dict[str, np.ndarray]:
    return {param.name: param.asnumpy() for param in model.get_parameters()}


def load(model: Llama, values: dict[str, np.ndarray]) -> None:
    for param in model.get_parameters():
        param.set_data(ms.Tensor(values[param.name], ms.float32))


# ------------------------------------------------------------------------------------------ forward


def test_logits_have_batch_sequence_vocab_shape_in_fp32():
    model = build()
    assert model(ms.Tensor(random_tokens())).shape == (2, SEQ, VOCAB)
    shorter = model(ms.Tensor(random_tokens(batch=3, seq=7)))
    assert shorter.shape == (3, 7, VOCAB) and shorter.dtype == ms.float32


def test_changing_a_future_token_never_changes_earlier_logits():
    model, tokens = build(), random_tokens()
    changed = tokens.copy()
    changed[:, 9] = (changed[:, 9] + 1) % VOCAB
    before, after = logits_of(model, tokens), logits_of(model, changed)
    np.testing.assert_array_equal(before[:, :9], after[:, :9])
    assert np.abs(before[:, 9:] - after[:, 9:]).max() > 1e-4


def test_rope_score_depends_only_on_position_difference():
    head_dim = 16
    cos, sin = (t.asnumpy() for t in rope_tables(head_dim, 64, theta=10_000.0))
    q, k = np.random.default_rng(0).standard_normal((2, head_dim)).astype(np.float32)

    def score(q_position: int, k_position: int) -> float:
        def rotated(x, position):
            return apply_rotary(ms.Tensor(x), ms.Tensor(cos[position]), ms.Tensor(sin[position])).asnumpy()

        return float(rotated(q, q_position) @ rotated(k, k_position))

    assert score(7, 3) == pytest.approx(score(40, 36), abs=1e-4)
    assert score(3, 3) == pytest.approx(score(50, 50), abs=1e-4)
    assert abs(score(7, 3) - score(7, 4)) > 1e-3
    np.testing.assert_allclose(apply_rotary(ms.Tensor(q), ms.Tensor(cos[0]), ms.Tensor(sin[0])).asnumpy(), q)


# ----------------------------------------------------------------------------------------- attention


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Plain multi-head attention in float64; k/v have as many heads as q."""
    scores = q.astype(np.float64) @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)) @ v


def test_attention_with_all_kv_heads_is_plain_multi_head_attention():
    q, k, v = np.random.default_rng(1).standard_normal((3, 2, 4, 8, 16)).astype(np.float32)
    causal = np.tril(np.ones((8, 8), dtype=bool))
    out = Attention(16)(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v), ms.Tensor(causal)).asnumpy()
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal), atol=1e-5)


def test_grouped_query_attention_shares_each_kv_head_with_consecutive_query_heads():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 8, 16)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 2, 8, 16)).astype(np.float32)
    causal = np.tril(np.ones((8, 8), dtype=bool))
    out = Attention(16)(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v), ms.Tensor(causal)).asnumpy()
    expected = reference_attention(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), causal)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_gqa_model_equals_mha_model_with_duplicated_kv_weights():
    gqa, mha = build(num_kv_heads=2), build(num_kv_heads=4)
    values = weights(gqa)
    head_dim = 64 // 4
    for name in list(values):
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # [kv_heads * head_dim, hidden] -> one copy per query head
            per_head = values[name].reshape(2, 1, head_dim, 64)
            values[name] = np.broadcast_to(per_head, (2, 2, head_dim, 64)).reshape(4 * head_dim, 64)
    load(mha, values)
    tokens = random_tokens()
    np.testing.assert_allclose(logits_of(mha, tokens), logits_of(gqa, tokens), atol=1e-5)


# -------------------------------------------------------------------------------- document boundaries


def test_document_positions_restart_at_each_start():
    positions, segments = document_positions([0, 5, 11], 16)
    np.testing.assert_array_equal(positions, [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(segments, [0] * 5 + [1] * 6 + [2] * 5)
    assert positions.dtype == segments.dtype == np.int32


def test_document_positions_ignore_target_only_starts_and_treat_a_leading_tail_as_a_segment():
    positions, segments = document_positions(np.array([3, 8], dtype=np.int32), 8)
    np.testing.assert_array_equal(positions, [0, 1, 2, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(segments, [0, 0, 0, 1, 1, 1, 1, 1])


@pytest.mark.parametrize("bad", [[0, 5, 5], [4, 2], [-1, 3]])
def test_document_positions_reject_unordered_or_negative_starts(bad):
    with pytest.raises(ValueError, match="doc_starts"):
        document_positions(bad, 16)


def test_second_document_sees_only_itself_from_position_zero():
    model, tokens = build(), random_tokens()
    positions, segments = document_positions([0, 6], SEQ)
    packed = logits_of(model, tokens, np.stack([positions] * 2), np.stack([segments] * 2))
    alone = logits_of(model, tokens[:, 6:])
    np.testing.assert_allclose(packed[:, 6:], alone, atol=1e-5)
    np.testing.assert_allclose(packed[:, :6], logits_of(model, tokens)[:, :6], atol=1e-5)
    assert np.abs(logits_of(model, tokens)[:, 6:] - alone).max() > 1e-3


# ------------------------------------------------------------------------------ init, head, counting


def test_init_is_normal_with_scaled_residual_outputs_and_unit_norms():
    model = build(seed=3, init_std=0.05, num_layers=2)
    values = weights(model)
    scaled = 0.05 / math.sqrt(2 * 2)
    for name, value in values.items():
        if name.endswith("norm.weight"):
            np.testing.assert_array_equal(value, 1.0)
            continue
        expected_std = scaled if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.05
        assert value.std() == pytest.approx(expected_std, rel=0.05), name
        assert abs(value.mean()) < 0.1 * expected_std, name


def test_same_seed_same_weights_other_seed_other_weights():
    first, again, other = weights(build(seed=5)), weights(build(seed=5)), weights(build(seed=6))
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    assert not np.array_equal(first["layers.1.mlp.up_proj.weight"], other["layers.1.mlp.up_proj.weight"])


def test_tied_head_is_the_embedding_and_untied_head_is_its_own_matrix():
    tied, untied = build(tie_embeddings=True), build(tie_embeddings=False)
    assert "lm_head.weight" not in weights(tied) and weights(untied)["lm_head.weight"].shape == (VOCAB, 64)
    values = weights(tied)
    load(untied, {**values, "lm_head.weight": values["embed_tokens.weight"]})
    tokens = random_tokens()
    np.testing.assert_allclose(logits_of(untied, tokens), logits_of(tied, tokens), atol=1e-6)
    values["lm_head.weight"] = np.random.default_rng(0).standard_normal((VOCAB, 64)).astype(np.float32)
    load(untied, values)
    assert np.abs(logits_of(untied, tokens) - logits_of(tied, tokens)).max() > 1e-3


def test_count_parameters_with_and_without_embeddings():
    hidden, ffn, kv = 64, 96, 2 * 16
    per_layer = hidden * (hidden + 2 * kv + hidden) + 3 * hidden * ffn + 2 * hidden
    body = 2 * per_layer + hidden
    tied, untied = build(tie_embeddings=True), build(tie_embeddings=False)
    assert count_parameters(tied) == body + VOCAB * hidden
    assert count_parameters(tied, include_embeddings=False) == body
    assert count_parameters(untied) == body + 2 * VOCAB * hidden
    assert count_parameters(untied, include_embeddings=False) == body + VOCAB * hidden


# ---------------------------------------------------------------------------------------------- loss


def test_loss_averages_over_counted_tokens_only():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((2, 5, 11)).astype(np.float32)
    labels = rng.integers(0, 11, (2, 5)).astype(np.int32)
    labels[0, 1] = labels[1, 4] = -100
    loss_mask = np.ones((2, 5), dtype=np.float32)
    loss_mask[1, 0] = 0
    counted = (labels != -100) & (loss_mask != 0)

    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, np.where(counted, labels, 0)[..., None], -1)[..., 0]
    loss, count = token_cross_entropy(ms.Tensor(logits), ms.Tensor(labels), ms.Tensor(loss_mask))
    assert int(count.asnumpy()) == counted.sum() == 7
    assert float(loss.asnumpy()) == pytest.approx(nll[counted].mean(), rel=1e-5)

    logits[~counted] = 100.0 * rng.standard_normal(logits[~counted].shape)
    moved, _ = token_cross_entropy(ms.Tensor(logits), ms.Tensor(labels), ms.Tensor(loss_mask))
    assert float(moved.asnumpy()) == pytest.approx(float(loss.asnumpy()), rel=1e-6)


def test_loss_without_counted_tokens_is_zero():
    logits = np.zeros((1, 3, 5), dtype=np.float32)
    loss, count = token_cross_entropy(ms.Tensor(logits), ms.Tensor(np.full((1, 3), -100, dtype=np.int32)))
    assert (float(loss.asnumpy()), float(count.asnumpy())) == (0.0, 0.0)


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_a_vocabulary_padded_for_tensor_parallelism_gives_the_unpadded_loss_and_gradients(tie_embeddings):
    """Padding rows hold large random values, as a converted model's could after training: masked, they change
    neither the loss nor any gradient, and get none; unmasked, they move the loss."""
    padding = 3
    unpadded = build(tie_embeddings=tie_embeddings)
    values = weights(unpadded)
    rng = np.random.default_rng(5)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in values:
            values[name] = np.concatenate([values[name], rng.standard_normal((padding, 64)).astype(np.float32)])
    padded = build(tie_embeddings=tie_embeddings, vocab_size=VOCAB + padding, vocab_padding=padding)
    unmasked = build(tie_embeddings=tie_embeddings, vocab_size=VOCAB + padding)
    load(padded, values)
    load(unmasked, values)
    tokens = random_tokens()
    inputs = [ms.Tensor(a) for a in (tokens[:, :-1], tokens[:, 1:])]

    def loss_and_gradients(model):
        grad_fn = ms.value_and_grad(lambda x, y: token_cross_entropy(model(x), y)[0], None, model.trainable_params())
        loss, grads = grad_fn(*inputs)
        return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(model.trainable_params(), grads)}

    loss, grads = loss_and_gradients(unpadded)
    padded_loss, padded_grads = loss_and_gradients(padded)
    assert padded_loss == pytest.approx(loss, rel=1e-6)
    for name, gradient in grads.items():  # a matmul of another width sums in another order
        difference = padded_grads[name][: gradient.shape[0]] - gradient
        assert np.linalg.norm(difference) <= 1e-6 * np.linalg.norm(gradient), name
    head = "embed_tokens.weight" if tie_embeddings else "lm_head.weight"
    assert not np.any(padded_grads[head][VOCAB:])
    assert abs(loss_and_gradients(unmasked)[0] - loss) > 1e-3
    assert logits_of(padded, tokens)[..., VOCAB:].max() < -1e8  # and generation never picks them


# ------------------------------------------------------------------------------- graph mode, dtypes


def test_forward_and_gradients_compile_under_jit_with_the_same_result():
    model, tokens = build(), random_tokens()
    positions, segments = (np.stack([a] * 2) for a in document_positions([0, 6], SEQ))
    inputs = [ms.Tensor(a) for a in (tokens[:, :-1], positions[:, :-1], segments[:, :-1], tokens[:, 1:])]

    def loss_fn(tokens, position_ids, segment_ids, labels):
        return token_cross_entropy(model(tokens, position_ids, segment_ids), labels)[0]

    grad_fn = ms.value_and_grad(loss_fn, None, model.trainable_params())
    compiled = ms.jit(grad_fn)
    eager_loss, eager_grads = grad_fn(*inputs)
    graph_loss, graph_grads = compiled(*inputs)
    assert float(graph_loss.asnumpy()) == pytest.approx(float(eager_loss.asnumpy()), rel=1e-5)
    for eager, graph in zip(eager_grads, graph_grads, strict=True):
        np.testing.assert_allclose(graph.asnumpy(), eager.asnumpy(), atol=1e-6)
    assert all(np.abs(g.asnumpy()).max() > 0 for g in graph_grads)


def test_fp16_compute_stays_close_to_fp32():
    tokens = random_tokens()
    half = build(compute_dtype="float16")
    logits = half(ms.Tensor(tokens))
    assert logits.dtype == ms.float32
    np.testing.assert_allclose(logits.asnumpy(), logits_of(build(), tokens), atol=2e-2)


# ------------------------------------------------------------------------------ hand-written backward


def _plain_rms_norm(x, weight):
    return x * ms.mint.rsqrt(ms.mint.mean(x * x, dim=-1, keepdim=True) + 1e-5) * weight


def _plain_attention(q, k, v, mask):
    bias = ms.ops.logical_not(mask).astype(ms.float32) * float(np.finfo(np.float32).min)
    scores = ms.mint.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(q.shape[-1]) + bias
    return ms.mint.matmul(ms.mint.softmax(scores, dim=-1), v)


def _plain_nll(logits, labels):
    return -ms.ops.gather_d(ms.ops.log_softmax(logits, -1), 1, labels.reshape(-1, 1)).reshape(-1)


def _rms_norm_off_cpu():
    """RMSNormFunction as it runs on devices without fp64 matmuls: the mean kernel instead."""
    norm = fused.RMSNormFunction(1e-5)
    norm.fp64_matmul_mean = False
    return norm


def _fused_cases():
    rng = np.random.default_rng(11)

    def tensor(*shape):
        return ms.Tensor(rng.standard_normal(shape).astype(np.float32))

    causal = ms.Tensor(np.tril(np.ones((6, 6), dtype=bool)))
    cos, sin = (t[:6] for t in rope_tables(8, 16, theta=10_000.0))
    labels = ms.Tensor(rng.integers(0, 11, 10).astype(np.int32))
    return [
        (fused.LinearFunction(), lambda x, w: ms.mint.matmul(x, w.T), (tensor(2, 5, 7), tensor(3, 7)), 2),
        (fused.RMSNormFunction(1e-5), _plain_rms_norm, (tensor(2, 5, 8), tensor(8)), 2),
        (_rms_norm_off_cpu(), _plain_rms_norm, (tensor(2, 5, 8), tensor(8)), 2),
        (fused.RotaryFunction(), lambda x, c, s: x * c + ms.mint.cat((-x[..., 4:], x[..., :4]), dim=-1) * s, (tensor(2, 3, 6, 8), cos, sin), 1),
        (fused.SoftmaxAttentionFunction(1 / math.sqrt(8)), _plain_attention, (tensor(2, 3, 6, 8), tensor(2, 3, 6, 8), tensor(2, 3, 6, 8), causal), 3),
        (fused.TokenNLLFunction(), _plain_nll, (tensor(10, 11), labels), 1),
        (fused.SwiGLUFunction(), lambda g, u: ms.mint.nn.functional.silu(g) * u, (tensor(2, 5, 7), tensor(2, 5, 7)), 2),
        (fused.HeadsFirst(), lambda x: x.swapaxes(1, 2), (tensor(2, 5, 3, 4),), 1),
        (fused.HeadsLast(), lambda x: x.swapaxes(1, 2), (tensor(2, 3, 5, 4),), 1),
    ]


@pytest.mark.parametrize(
    "case",
    range(9),
    ids=["linear", "rms_norm", "rms_norm_off_cpu", "rotary", "attention", "nll", "swiglu", "heads_first", "heads_last"],
)
def test_hand_written_backward_matches_automatic_differentiation(case):
    function, plain, inputs, differentiable = _fused_cases()[case]
    weights = ms.Tensor(np.random.default_rng(case).standard_normal(plain(*inputs).shape).astype(np.float32))
    positions = tuple(range(differentiable))

    def objective(f):
        return lambda *args: (f(*args) * weights).sum()

    np.testing.assert_allclose(function(*inputs).asnumpy(), plain(*inputs).asnumpy(), atol=1e-5)
    ours = ms.grad(objective(function), positions)(*inputs)
    reference = ms.grad(objective(plain), positions)(*inputs)
    for mine, expected in zip(ours if differentiable > 1 else (ours,), reference if differentiable > 1 else (reference,)):
        np.testing.assert_allclose(mine.asnumpy(), expected.asnumpy(), atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_after_passes_both_values_and_their_gradients_through_unchanged(compiled):
    rng = np.random.default_rng(0)
    earlier, x, d_earlier, d_x = (ms.Tensor(rng.standard_normal(shape).astype(np.float32))
                                  for shape in ((2, 5, 3), (2, 5, 7), (2, 5, 3), (2, 5, 7)))
    after = fused.After()

    def objective(earlier, x):
        first, second = after(earlier, x)
        return (first * d_earlier).sum() + (second * d_x).sum()

    values = after(earlier, x)
    grads = ms.grad(ms.jit(objective) if compiled else objective, (0, 1))(earlier, x)
    for got, expected in zip((*values, *grads), (earlier, x, d_earlier, d_x), strict=True):
        np.testing.assert_array_equal(got.asnumpy(), expected.asnumpy())


def test_attention_in_query_blocks_matches_one_block(monkeypatch):
    """Blocks of 4 query rows over 6 queries (the last block short) against 10 keys under a [B, 1, T, S] mask of
    documents: the output and dq, dk, dv of the plain formulation."""
    monkeypatch.setattr(fused, "QUERY_BLOCK_SCORES", 2 * 3 * 4 * 10)
    monkeypatch.setattr(fused, "MIN_QUERY_BLOCK_ROWS", 1)
    assert fused.query_block_rows(2, 3, 10, 6) == 4
    rng = np.random.default_rng(12)
    q, k, v = (ms.Tensor(rng.standard_normal(shape).astype(np.float32)) for shape in ((2, 3, 6, 8), (2, 3, 10, 8), (2, 3, 10, 8)))
    segments = np.array([[0] * 5 + [1] * 5, [0] * 2 + [1] * 8])
    query_tokens = np.arange(4, 10)
    mask = (segments[:, query_tokens, None] == segments[:, None, :]) & (np.arange(10)[None, :] <= query_tokens[:, None])
    mask = ms.Tensor(mask[:, None])  # [2, 1, 6, 10]
    blocked = fused.SoftmaxAttentionFunction(1 / math.sqrt(8))
    weights = ms.Tensor(rng.standard_normal((2, 3, 6, 8)).astype(np.float32))

    def objective(f):
        return lambda *args: (f(*args) * weights).sum()

    np.testing.assert_allclose(blocked(q, k, v, mask).asnumpy(), _plain_attention(q, k, v, mask).asnumpy(), atol=1e-6)
    ours = ms.grad(objective(blocked), (0, 1, 2))(q, k, v, mask)
    reference = ms.grad(objective(_plain_attention), (0, 1, 2))(q, k, v, mask)
    for mine, expected in zip(ours, reference):
        np.testing.assert_allclose(mine.asnumpy(), expected.asnumpy(), atol=1e-5)


def test_fused_forwards_are_bit_for_bit_the_plain_formulation():
    """RMSNorm's fp64-matmul mean, the Gather head moves, RoPE's signed sine table and the spelled-out silu must
    not change a bit: the trainer's accumulation test depends on the last bits of the forward."""
    rng = np.random.default_rng(5)
    x = ms.Tensor((rng.standard_normal((2, 32, 512)) * 3).astype(np.float32))
    norm_weight = ms.Tensor(rng.uniform(0.5, 1.5, 512).astype(np.float32))
    rms_normed = fused.RMSNormFunction(1e-5)(x, norm_weight)
    np.testing.assert_array_equal(rms_normed.asnumpy(), _plain_rms_norm(x, norm_weight).asnumpy())

    heads = x.reshape(2, 32, 8, 64)  # [B, T, H, D]
    np.testing.assert_array_equal(fused.heads_first(heads).asnumpy(), heads.swapaxes(1, 2).asnumpy())
    np.testing.assert_array_equal(fused.heads_last(heads).asnumpy(), heads.swapaxes(1, 2).asnumpy())

    q = heads.swapaxes(1, 2)  # [B, H, T, D]
    cos, sin = rope_tables(64, 32, theta=10_000.0)
    plain_rotary = q * cos + ms.mint.cat((-q[..., 32:], q[..., :32]), dim=-1) * sin
    np.testing.assert_array_equal(apply_rotary(q, cos, sin).asnumpy(), plain_rotary.asnumpy())

    gate, up = x, x * 0.5 + 1.0
    plain_swiglu = ms.mint.nn.functional.silu(gate) * up
    np.testing.assert_array_equal(fused.SwiGLUFunction()(gate, up).asnumpy(), plain_swiglu.asnumpy())


def test_decodings_fewer_kernel_forms_compute_the_plain_formulas():
    """RoPE as per-position rotation matrices, RMSNorm and SwiGLU through Addcmul: what `Llama.decode` runs."""
    rng = np.random.default_rng(3)
    x = ms.Tensor((rng.standard_normal((3, 1, 64)) * 3).astype(np.float32))  # [B, n, hidden]
    norm = RMSNorm(64, 1e-5)
    norm.weight.set_data(ms.Tensor(rng.uniform(0.5, 1.5, 64).astype(np.float32)))
    np.testing.assert_allclose(norm.construct_cached(x).asnumpy(), _plain_rms_norm(x, norm.weight).asnumpy(), rtol=1e-6)

    mlp = SwiGLU(tiny_params(hidden_size=64, ffn_hidden_size=96), output_std=0.02)
    np.testing.assert_allclose(mlp.construct_cached(x).asnumpy(), mlp(x).asnumpy(), rtol=1e-5, atol=1e-7)

    cos, sin = (table[[5, 0, 17]] for table in rope_tables(64, 32, theta=10_000.0))  # three positions
    rotations = rotation_matrices(cos, fused.sign_first_half(sin), rotation_basis(64))  # [3, 64, 64]
    q = ms.Tensor(rng.standard_normal((3, 4, 64)).astype(np.float32))  # [positions, heads, D]
    elementwise = apply_rotary(q, cos.unsqueeze(1), sin.unsqueeze(1))
    np.testing.assert_allclose(ms.ops.matmul(q, rotations).asnumpy(), elementwise.asnumpy(), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------ Hugging Face


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_logits_match_hugging_face_llama(tie_embeddings):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    params = tiny_params(num_layers=3, num_heads=4, num_kv_heads=2, tie_embeddings=tie_embeddings, rope_theta=500.0)
    config = transformers.LlamaConfig(
        vocab_size=params.vocab_size,
        hidden_size=params.hidden_size,
        intermediate_size=params.ffn_hidden_size,
        num_hidden_layers=params.num_layers,
        num_attention_heads=params.num_heads,
        num_key_value_heads=params.num_kv_heads,
        max_position_embeddings=params.seq_len,
        rope_theta=params.rope_theta,
        rms_norm_eps=params.norm_eps,
        tie_word_embeddings=tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to ones; randomise them so they are compared too
        for name, tensor in reference.named_parameters():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
    hf_weights = {name: tensor.numpy() for name, tensor in reference.state_dict().items()}
    mapped, converted_params = from_hf(hf_weights, config.to_dict())
    assert converted_params == params

    ms.set_seed(1)
    model = Llama(params)
    load(model, mapped)

    tokens = random_tokens(seed=7)
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert np.abs(logits_of(model, tokens) - expected).max() <= 1e-4
