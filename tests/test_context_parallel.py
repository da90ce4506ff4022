"""Context parallelism: the chunking and mask arithmetic in one process; the layout's cp groups; the rules that
refuse what cannot run; the planner's cp arithmetic; and under msrun, cp2 alone, with tp2, and with dp2 under ZeRO-3
and recompute (with pp2 and under LoRA with -m extended) equal to one process in loss and gradient norm over 10
steps on packed rows with document resets (attention and positions restart at each document), and a cp2 checkpoint
resumed in one process."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from conftest import FOUR_WORKER_JOBS, SMALL_MODEL, TWO_WORKER_JOBS
from mindspore import Tensor, nn, ops
from test_parallel_msrun import RUN, assert_same_metrics, resume_from_step, shared_or_own_job, train_job

from model_core.data import open_split
from model_core.model.attention import Attention, CausalMask
from model_core.model.documents import document_positions
from model_core.model.llama import Llama
from model_core.model.weights import load_weights, model_weights
from model_core.parallel.context import ContextParallelMask, context_parallel, gathered_order, sequence_chunks
from model_core.parallel.layout import Layout
from model_core.train.checkpoint import Checkpoint
from model_core.train.loader import Batch, context_shard
from model_core.train.trainer import Trainer
from params import load_params
from params.rules import ParallelConfigError, check_run

# 10 steps with document resets (segment ids and positions that restart at every document of a row), checkpoints
# and validation every 5.
CP_RUN = ("train.steps=10", "train.checkpoint_interval=5", "train.eval_interval=5",
          "train.reset_at_document_boundaries=true")
LORA = ("lora.dropout=0", "--lora=yes")  # dropout would draw other masks for other shapes


# ------------------------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_rank_holds_two_mirrored_chunks_and_the_same_causal_work(cp):
    seq = 8 * cp
    held = [sequence_chunks(seq, cp, index) for index in range(cp)]
    assert sorted(np.concatenate(held).tolist()) == list(range(seq))  # every token once
    np.testing.assert_array_equal(gathered_order(seq, cp), np.concatenate(held))
    chunk = seq // (2 * cp)
    for index, tokens in enumerate(held):
        assert tokens[:chunk].tolist() == list(range(index * chunk, (index + 1) * chunk))
        assert tokens[chunk] == (2 * cp - 1 - index) * chunk
    work = [int((tokens + 1).sum()) for tokens in held]  # keys each rank's queries see under a causal mask
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="seq_len=10 must split into 2 x cp=4"):
        sequence_chunks(10, 2, 0)


class _GatheredSegments(nn.Cell):
    """A cp group as one rank sees it, whose all-gather returns the whole row's segment ids in gather order."""

    def __init__(self, size: int, index: int, gathered: np.ndarray) -> None:
        super().__init__()
        self.size, self.index, self.gathered = size, index, Tensor(gathered.astype(np.float32))

    def all_gather(self, x, axis=0):
        return self.gathered


def _full_mask(segments: np.ndarray) -> np.ndarray:
    seq = segments.shape[1]
    return np.tril(np.ones((seq, seq), bool))[None] & (segments[:, :, None] == segments[:, None, :])


def test_cp_attention_of_each_rank_equals_its_rows_of_whole_sequence_attention_with_gqa():
    """Each rank's queries over the gathered keys and values (in gather order, kv heads fewer than query heads),
    masked by `ContextParallelMask`, give that rank's rows of one-process attention over documents."""
    seq, cp, heads, kv_heads, dim = 16, 2, 4, 2, 8
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, heads, seq, dim)).astype(np.float32)
    k, v = (rng.standard_normal((2, kv_heads, seq, dim)).astype(np.float32) for _ in range(2))
    segments = np.array([[0] * 5 + [1] * 11, [0] * 9 + [1] * 4 + [2] * 3], np.int32)
    attention = Attention(dim)
    whole = attention(Tensor(q), Tensor(k), Tensor(v), CausalMask(seq)(seq, Tensor(segments))).asnumpy()
    order = gathered_order(seq, cp)
    for index in range(cp):
        mine = sequence_chunks(seq, cp, index)
        mask = ContextParallelMask(seq, _GatheredSegments(cp, index, segments[:, order]))(seq // cp, Tensor(segments[:, mine]))
        full = _full_mask(segments)  # the one-process mask, its rows and columns taken in this rank's order
        np.testing.assert_array_equal(mask.asnumpy()[:, 0], full[:, mine][:, :, order])
        got = attention(Tensor(q[:, :, mine]), Tensor(k[:, :, order]), Tensor(v[:, :, order]), mask).asnumpy()
        np.testing.assert_allclose(got, whole[:, :, mine], rtol=1e-5, atol=1e-6)


class _StackedGroup(nn.Cell):
    """Every cp rank's shard of a batch of `rows` rows stacked along the batch axis of one process: all-gather joins
    the stacked blocks along `axis` and gives each its copy, reduce-scatter sums them and hands each its block."""

    def __init__(self, cp: int, rows: int) -> None:
        super().__init__()
        self.size, self.index, self.rows = cp, 0, rows

    def all_gather(self, x, axis=0):
        return ops.cat([ops.cat(ops.split(x, self.rows, 0), axis)] * self.size, 0)

    def reduce_scatter(self, x, axis=0):
        blocks = ops.split(x, self.rows, 0)
        total = blocks[0]
        for block in blocks[1:]:
            total = total + block
        return ops.cat(ops.split(total, total.shape[axis] // self.size, axis), 0)


class _StackedMask(ContextParallelMask):
    """`ContextParallelMask` of every rank at once, for `_StackedGroup`: each block of rows gets its rank's queries."""

    def __init__(self, seq_len: int, group: _StackedGroup) -> None:
        super().__init__(seq_len, group)
        queries = np.stack([sequence_chunks(seq_len, group.size, rank) for rank in range(group.size)])
        self.query_tokens = Tensor(np.repeat(queries, group.rows, axis=0)[:, :, None])  # [cp x B, T / cp, 1]

    def construct(self, seq, segment_ids):
        local = segment_ids.astype(ms.float32)
        everyone = self.group.all_gather(local, 1)
        causal = self.key_tokens.reshape(1, 1, -1) <= self.query_tokens
        return ops.logical_and(local.unsqueeze(2) == everyone.unsqueeze(1), causal).unsqueeze(1)


@pytest.mark.parametrize("cp, recompute", [(2, True), (4, False)])
def test_cp_ranks_simulated_in_one_process_give_the_loss_and_gradients_of_the_whole_sequence(cp, recompute):
    """The model with cp attention swapped in (`context_parallel`), every rank's chunks of packed rows stacked
    along the batch and exchanged by `_StackedGroup`: the summed loss and every gradient are the one-process ones
    (the stacked batch sums the ranks' gradients, as the dp x cp sum does)."""
    params = load_params("tiny", SMALL_MODEL).model
    ms.set_seed(0)
    whole = Llama(params)
    rows, seq = 2, params.seq_len
    tokens = np.random.default_rng(0).integers(0, params.vocab_size, (rows, seq + 1)).astype(np.int32)
    pairs = [document_positions(starts, seq) for starts in ([0, 5, 20], [0, 13])]
    positions, segments = np.stack([p for p, _ in pairs]), np.stack([s for _, s in pairs])
    expected, expected_grads = _loss_and_gradients(whole, tokens[:, :-1], positions, segments, tokens[:, 1:])
    model = Llama(params)
    load_weights(model, model_weights(whole))
    group = _StackedGroup(cp, rows)
    context_parallel(model, group)
    model.attention_mask = _StackedMask(seq, group)
    if recompute:
        for layer in model.layers:
            layer.recompute()

    def stacked(array):
        return np.concatenate([array[:, sequence_chunks(seq, cp, rank)] for rank in range(cp)])

    loss, grads = _loss_and_gradients(model, stacked(tokens[:, :-1]), stacked(positions), stacked(segments),
                                      stacked(tokens[:, 1:]))
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    without_documents = _loss_and_gradients(whole, tokens[:, :-1], positions, np.zeros_like(segments), tokens[:, 1:])[0]
    assert abs(without_documents - expected) > 1e-4 * abs(expected)  # the segment ids matter, far beyond 1e-6


def _loss_and_gradients(model, tokens, positions, segments, labels):
    def summed(tokens, positions, segments, labels):
        logits = model(tokens, positions, segments)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")

    loss, grads = ms.value_and_grad(summed, None, model.trainable_params())(
        *(Tensor(array) for array in (tokens, positions, segments, labels))
    )
    return float(loss.asnumpy()), [grad.asnumpy() for grad in grads]


def test_context_shard_takes_each_ranks_chunks_with_whole_row_positions_and_segments():
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    batch = Batch(tokens, tokens + 1, np.ones((2, 8), np.float32), None, None)
    assert context_shard(batch, 1, 0) is batch
    rank1 = context_shard(batch, 2, 1)
    assert rank1.tokens.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert rank1.labels.tolist() == [[3, 4, 5, 6], [11, 12, 13, 14]]
    assert rank1.position_ids.tolist() == [[2, 3, 4, 5]] * 2  # RoPE of the whole row
    assert rank1.segment_ids.tolist() == [[0, 0, 0, 0]] * 2
    positions = np.array([[0, 1, 2, 0, 1, 2, 3, 4]] * 2, np.int32)
    segments = np.array([[0, 0, 0, 1, 1, 1, 1, 1]] * 2, np.int32)
    rank0 = context_shard(Batch(tokens, tokens, np.ones((2, 8), np.float32), positions, segments), 2, 0)
    assert rank0.position_ids.tolist() == [[0, 1, 3, 4]] * 2 and rank0.segment_ids.tolist() == [[0, 0, 1, 1]] * 2
    assert sum(context_shard(batch, 2, r).counted_tokens for r in range(2)) == batch.counted_tokens


def test_group_gathers_and_scatters_along_any_axis_by_the_fallbacks():
    from model_core.parallel import comm

    inputs = [np.arange(24, dtype=np.float32).reshape(2, 3, 4) + 100 * r for r in range(2)]
    total = sum(comm.gather_contribution(Tensor(x), r, 2, axis=2).asnumpy() for r, x in enumerate(inputs))
    np.testing.assert_array_equal(total, np.concatenate(inputs, axis=2))
    for rank in range(2):
        block = comm.own_block(Tensor(total), rank, 2, axis=2).asnumpy()
        np.testing.assert_array_equal(block, inputs[rank])


# ------------------------------------------------------------------------------------------ layout, rules


def test_cp_sits_between_tp_and_dp_and_folds_into_dp_for_the_weights():
    layout = Layout(dp=2, tp=2, pp=2, cp=2)
    assert layout.world_size == 16
    assert all(layout.rank(**vars(layout.coordinates(r))) == r for r in range(16))
    assert layout.all_groups("tp")[:2] == [(0, 1), (2, 3)]
    assert layout.cp_group(0) == (0, 2) and layout.cp_group(5) == (5, 7)
    assert layout.dp_group(0) == (0, 4) and layout.pp_group(0) == (0, 8)
    assert layout.replica_group(0) == (0, 2, 4, 6)  # dp x cp: gradients summed, ZeRO shards cut
    folded = layout.folded()
    assert (folded.dp, folded.cp, folded.tp, folded.pp) == (4, 1, 2, 2)
    assert all(folded.coordinates(r).tp == layout.coordinates(r).tp for r in range(16))
    assert str(layout) == "dp2 cp2 tp2 pp2"


def test_rules_refuse_a_sequence_2_x_cp_does_not_divide_and_name_cp_in_the_world_size():
    with pytest.raises(ValueError, match=r"model.seq_len=32 is not a multiple of 2 x parallel.context_parallel=6"):
        load_params("tiny", [*RUN, "parallel.context_parallel=3"])
    params = load_params("tiny", [*RUN, "parallel.context_parallel=2", "parallel.data_parallel=2"])
    assert params.parallel.world_size == 4
    with pytest.raises(ParallelConfigError, match=r"data_parallel=2 x context_parallel=2 x .* = 4 ranks, but the world has 2"):
        check_run(params, world_size=2)


def test_rules_refuse_cp_with_experts():
    moe = ["model.moe={num_experts: 4, experts_per_token: 2}"]
    with pytest.raises(ValueError, match=r"parallel.context_parallel=2 with model.moe .*dense models"):
        load_params("tiny", [*RUN, *moe, "parallel.context_parallel=2"])


# ------------------------------------------------------------------------------------------------ msrun


def test_some_small_rows_hold_several_documents(dataset_dir):
    """The shared small dataset's documents (docstrings) are long next to its 33-token rows: about one row in ten
    holds a boundary, enough for the resets to change the run (`test_document_resets_change_the_run`)."""
    split = open_split(dataset_dir, "train")
    rows = split.take(np.arange(min(len(split), 64)))
    length = rows.tokens.shape[1] - 1
    documents = [int(document_positions(rows.doc_starts(row), length)[1].max()) + 1 for row in range(len(rows))]
    assert sum(count >= 2 for count in documents) >= 4, documents


def _one_process(dataset_dir, out, *overrides: str, lora: bool = False) -> list[dict]:
    params = load_params("tiny", [*RUN, *CP_RUN, *(o for o in overrides if not o.startswith("--")),
                                  "parallel.micro_batches=4", f"train.output_dir={out}"])
    trainer = Trainer(params, dataset_dir, out / "ckpt", lora=params.lora if lora else None)
    return trainer.run().history


@pytest.fixture(scope="module")
def documents_reference(dataset_dir, tmp_path_factory):
    """CP_RUN in one process: 8 rows a step, attention and positions reset at documents."""
    out = tmp_path_factory.mktemp("cp-reference")
    return out, _one_process(dataset_dir, out)


CP2 = ("parallel.context_parallel=2", "parallel.micro_batches=4")
JOBS = {
    "cp2": (2, CP2),
    "tp2-cp2": (4, ("parallel.tensor_parallel=2", *CP2)),
    "pp2-cp2": (4, ("parallel.pipeline_parallel=2", *CP2)),
    # ZeRO-3 and recompute in one job, as the 32K preset runs them (a recomputed layer gathers its shards again)
    "dp2-cp2-zero3-recompute": (4, ("parallel.data_parallel=2", "parallel.context_parallel=2",
                                    "parallel.micro_batches=2", "parallel.zero_stage=3", "recompute.mode=all")),
}
EXTENDED_JOBS = ("pp2-cp2",)  # cp composed with another layout runs by default as tp2 x cp2 and dp2 x cp2
for name, (workers, overrides) in JOBS.items():
    if name not in EXTENDED_JOBS:
        (TWO_WORKER_JOBS if workers == 2 else FOUR_WORKER_JOBS)[name] = (*CP_RUN, *overrides)


@pytest.mark.slow
def test_document_resets_change_the_run(documents_reference, dataset_dir, tmp_path):
    """The segment ids matter: without the resets the same rows train to other losses (from the first step whose
    batch holds a row of several documents; only a few rows hold several)."""
    _, history = documents_reference
    without = _one_process(dataset_dir, tmp_path, "train.reset_at_document_boundaries=false")
    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(history, without, strict=True) if "loss" in a]
    assert max(differences) > 1e-3, differences


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.extended] if name in EXTENDED_JOBS else [])
                                  for name in JOBS])
def test_cp_layouts_match_one_process(name, request, documents_reference, tmp_path):
    workers, overrides = JOBS[name]
    _, ranks = shared_or_own_job(request, name, tmp_path, *CP_RUN, *overrides, workers=workers)
    for rank in ranks:
        assert_same_metrics(rank["history"], documents_reference[1])
        assert [r["step"] for r in rank["history"] if "validation_loss" in r] == [5, 10]


# -m extended: LoRA is trained under a layout by default in tests/test_finetune.py (dp2 ZeRO-1), cp2 without it here
@pytest.mark.extended
def test_cp2_lora_matches_one_process(dataset_dir, tmp_path):
    ranks = train_job(tmp_path / "cp2-lora", dataset_dir, *CP_RUN, *CP2, *LORA)
    expected = _one_process(dataset_dir, tmp_path, *LORA, lora=True)
    for rank in ranks:
        assert_same_metrics(rank["history"], expected)


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_in_one_process(two_worker_jobs, documents_reference, dataset_dir, tmp_path):
    out, _ = two_worker_jobs["cp2"]
    saved = out / "out" / "checkpoints"
    assert Checkpoint(saved / "step-00000010", 10).layout() == Layout(cp=2)
    resume_from_step(saved, 5, tmp_path / "ckpt")
    params = load_params("tiny", [*RUN, *CP_RUN, "parallel.micro_batches=4", f"train.output_dir={tmp_path}"])
    result = Trainer(params, dataset_dir, tmp_path / "ckpt").run(resume="auto")
    assert result.resumed_from.name == "step-00000005"
    assert_same_metrics(result.history, [r for r in documents_reference[1] if r["step"] > 5])


@pytest.mark.extended  # a cp2 checkpoint resumes in one process by default
def test_a_one_process_checkpoint_resumes_under_cp2(documents_reference, dataset_dir, tmp_path):
    out, history = documents_reference
    start = resume_from_step(out / "ckpt", 5, tmp_path / "out" / "checkpoints")
    ranks = train_job(tmp_path, dataset_dir, *CP_RUN, *CP2, resume=start)
    for rank in ranks:
        assert_same_metrics(rank["history"], [r for r in history if r["step"] > 5])


# -------------------------------------------------------------------------------------------------- planner


def test_planner_divides_activations_by_cp_and_counts_the_gathered_keys_and_values():
    from model_core.parallel.planner import ACCELERATOR, Candidate, activation_bytes, context_bytes_per_step

    params = load_params("llama2_7b_32k")
    one, two = (Candidate(1, 4, 1, 1, "none", cp=cp) for cp in (1, 2))
    ratio = activation_bytes(params, two, 0, ACCELERATOR) / activation_bytes(params, one, 0, ACCELERATOR)
    assert 0.5 < ratio < 0.6  # half of every activation, plus the other rank's keys and values and the mask
    assert context_bytes_per_step(params, one) == 0
    kv = 2 * 32768 * 4096 * 2 // 4  # one layer's whole-sequence K and V, bf16, 1/tp of the heads
    assert context_bytes_per_step(params, two) == 2 * 32 * 64 * kv // 2  # gather + scatter, 32 layers, 64 micro-batches


def test_planner_recommends_cp_only_when_no_layout_without_it_fits():
    from model_core.parallel.planner import format_plan_table, plan

    params = load_params("llama2_7b_32k")
    roomy = plan(params, 8, 64 * 2**30)
    assert roomy.recommended.candidate.cp == 1 and all(e.candidate.cp == 1 for e in roomy.estimates)
    tight = plan(params, 8, 20 * 2**30)
    assert tight.recommended.candidate.cp > 1
    assert not any(tight.advisable(e) for e in tight.estimates if e.candidate.cp == 1)
    table = format_plan_table(tight)
    assert "context parallelism: each rank receives" in table and " cp2 " in table
    assert any(e.candidate.cp > 1 for e in plan(params, 8, 64 * 2**30, context_parallel=True).estimates)


def test_planner_counts_attention_scores_on_cpu_where_no_fused_kernel_runs():
    """Without a fused kernel (CPU) a rank holds fp32 scores: one query block's [B, heads / tp, rows, T] while one
    layer's attention runs (rows as `fused.query_block_rows` picks them) and some [B, heads / tp, T / cp, T] for each
    layer; divided by tp and by cp. A fused kernel (accelerator) holds none."""
    from dataclasses import replace

    from model_core.parallel.planner import ACCELERATOR, CPU, Candidate, activation_bytes

    def scores(candidate, *overrides):
        params = load_params("tiny", ["model.seq_len=1024", "train.micro_batch_size=2", *overrides])
        without = replace(CPU, attention_score_buffers=0.0, attention_score_buffers_per_layer=0.0)
        return activation_bytes(params, candidate, 0, CPU) - activation_bytes(params, candidate, 0, without)

    def expected(layers, heads, queries, rows):  # micro-batch 2, 1024 keys
        block, whole = 2 * heads * rows * 1024 * 4, 2 * heads * queries * 1024 * 4
        return CPU.attention_score_buffers * block + layers * CPU.attention_score_buffers_per_layer * whole

    assert ACCELERATOR.attention_score_buffers == ACCELERATOR.attention_score_buffers_per_layer == 0
    assert scores(Candidate(1, 1, 1, 0, "none")) == pytest.approx(expected(4, 4, 1024, 512), abs=1)
    assert scores(Candidate(1, 1, 1, 0, "none"), "model.num_layers=8") == pytest.approx(expected(8, 4, 1024, 512), abs=1)
    assert scores(Candidate(1, 2, 1, 0, "none")) == pytest.approx(expected(4, 2, 1024, 1024), abs=1)
    assert scores(Candidate(1, 1, 1, 0, "none", cp=2)) == pytest.approx(expected(4, 4, 512, 512), abs=1)
