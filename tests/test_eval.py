"""Fixed-seed evaluation: KV-cache decoding against full recomputation, the sampler's rules, seeds across
runs and processes, held-out loss and perplexity, and the report files."""

from __future__ import annotations

import importlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
import sentencepiece as spm
from conftest import SMALL_MODEL
from mindspore import ops

from model_core.data import PackedRows, open_split, prepare_dataset
from model_core.eval import (
    EvalReport,
    GenerationConfig,
    PromptOutput,
    choose_token,
    generate,
    generate_batch,
    held_out_loss,
    write_report,
)
from model_core.eval.evaluate import evaluate_checkpoint, evaluate_model, load_model
from model_core.eval.generate import (
    CACHE_SLOT_STEP,
    PREFILL_CHUNK,
    cache_slots,
    penalize_repetition,
    prefill_padding,
    sampling_probabilities,
    top_k_mask,
    top_p_mask,
)
from model_core.eval.perplexity import HeldOutLoss
from model_core.model import Llama, document_positions
from model_core.model.lora import apply_lora, base_sha256, lora_layers, save_adapters
from model_core.model.weights import model_weights
from model_core.storage import write_safetensors
from params import load_params
from params.schema import EvalParams, ModelParams

generate_module = importlib.import_module("model_core.eval.generate")  # the package's `generate` is the function

VOCAB, SEQ = 512, 64
EOS = 2
TESTS_DIR = Path(__file__).resolve().parent


def small_params(**overrides) -> ModelParams:
    fields = {
        "vocab_size": VOCAB, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "ffn_hidden_size": 176, "seq_len": SEQ,
    }
    return ModelParams(**{**fields, **overrides})


def build(seed: int = 0, **overrides) -> Llama:
    ms.set_seed(seed)
    return Llama(small_params(**overrides))


def generation_model() -> Llama:
    """Untied, at 5x the default init scale: a fresh tied model greedily repeats its input token, this one
    continues with varied tokens that depend on the context."""
    return build(seed=3, init_std=0.1, tie_embeddings=False)


def prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, length).tolist()


SAMPLED = GenerationConfig(max_new_tokens=12, temperature=1.0, top_k=40, top_p=0.9, repetition_penalty=1.3)
GREEDY = GenerationConfig(max_new_tokens=12)


@pytest.fixture(scope="module")
def model() -> Llama:
    return generation_model()


@pytest.fixture(scope="module")
def tied_model() -> Llama:
    """The default init, tied head. Tests share models: each compiles its graphs once."""
    return build()


# ---------------------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("which", ["tied_model", "model"])
def test_cached_logits_equal_full_forward_logits(which, request):
    model = request.getfixturevalue(which)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 30)).astype(np.int32)
    full = model(ms.Tensor(tokens)).asnumpy()
    cache, pieces = model.empty_cache(1), []
    for start, stop in [(0, PREFILL_CHUNK), *((t, t + 1) for t in range(PREFILL_CHUNK, 30))]:
        pieces.append(model.decode(ms.Tensor(tokens[:, start:stop]), cache).asnumpy())
    assert cache.length == 30
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=0, atol=1e-5)


def test_left_padded_rows_decode_as_each_sequence_alone(model):
    """Rows of 30, 21 and 17 tokens in one cache: each row's logits are those of its own sequence."""
    lengths = (30, 21, 17)
    sequences = [np.random.default_rng(seed).integers(0, VOCAB, length) for seed, length in enumerate(lengths)]
    columns = np.zeros((3, 30), np.int32)
    for row, sequence in enumerate(sequences):
        columns[row, 30 - len(sequence) :] = sequence
    cache, pieces = model.empty_cache(3, [30 - length for length in lengths]), []
    for start, stop in [(0, PREFILL_CHUNK), *((t, t + 1) for t in range(PREFILL_CHUNK, 30))]:
        pieces.append(model.decode(ms.Tensor(columns[:, start:stop]), cache).asnumpy())
    together = np.concatenate(pieces, axis=1)
    for row, sequence in enumerate(sequences):
        alone = model(ms.Tensor(sequence.reshape(1, -1).astype(np.int32))).asnumpy()[0]
        np.testing.assert_allclose(together[row, 30 - len(sequence) :], alone, rtol=0, atol=1e-5)


def test_decode_writes_the_cache_in_place_and_a_new_cache_starts_empty(tied_model):
    tokens = ms.Tensor(np.arange(PREFILL_CHUNK + 1, dtype=np.int32).reshape(1, -1))
    cache = tied_model.empty_cache(1)
    tied_model.decode(tokens[:, :PREFILL_CHUNK], cache)
    first = tied_model.decode(tokens[:, PREFILL_CHUNK:], cache)
    assert cache.length == PREFILL_CHUNK + 1
    again = tied_model.empty_cache(1)  # shares the slots of `cache`, whose stale contents no query sees
    tied_model.decode(tokens[:, :PREFILL_CHUNK], again)
    np.testing.assert_array_equal(tied_model.decode(tokens[:, PREFILL_CHUNK:], again).asnumpy(), first.asnumpy())
    assert all(param.name.startswith(("embed_tokens", "layers", "norm")) for param in tied_model.get_parameters())


def test_a_cache_smaller_than_seq_len_gives_the_full_forward_logits(model):
    """32 slots, batch 2: the graphs of the sized-cache generation test below, so neither compiles its own."""
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 20)).astype(np.int32)
    cache, pieces = model.empty_cache(2, [0, 3], slots=32), []
    for start, stop in [(0, PREFILL_CHUNK), *((t, t + 1) for t in range(PREFILL_CHUNK, 20))]:
        pieces.append(model.decode(ms.Tensor(tokens[:, start:stop]), cache).asnumpy())
    together = np.concatenate(pieces, axis=1)
    np.testing.assert_allclose(together[0], model(ms.Tensor(tokens[:1])).asnumpy()[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(together[1, 3:], model(ms.Tensor(tokens[1:, 3:])).asnumpy()[0], rtol=0, atol=1e-5)
    cache.length = 31
    with pytest.raises(ValueError, match="2 new tokens after 31 cached positions exceed the cache's 32 slots"):
        model.decode(ms.Tensor(tokens[:, :2]), cache)
    with pytest.raises(ValueError, match=f"a KV cache of slots={SEQ + 1} must hold 1 to seq_len={SEQ} positions"):
        model.empty_cache(1, slots=SEQ + 1)


def test_cache_slots_cover_the_generation_in_steps_of_the_slot_step_up_to_seq_len():
    assert cache_slots(12, 64, 256) == 2 * CACHE_SLOT_STEP and cache_slots(64, 0, 256) == CACHE_SLOT_STEP
    assert cache_slots(19, 64, 256) >= 19 + 64 and cache_slots(200, 64, 256) == 256


def test_prompts_are_padded_to_whole_prefill_chunks_where_the_cache_has_room():
    assert prefill_padding(12, 64, 256) == PREFILL_CHUNK - 12 and prefill_padding(2 * PREFILL_CHUNK, 64, 256) == 0
    # 200 prompt + 56 new tokens fill all 256 slots: 8 columns of padding would end the generation 8 tokens early.
    assert prefill_padding(200, 56, 256) == 0 and prefill_padding(200, 48, 256) == 8


def test_a_short_prompt_enters_the_cache_in_one_step(model, monkeypatch):
    shapes, decode = [], model.decode
    monkeypatch.setattr(model, "decode", lambda tokens, cache: shapes.append(tokens.shape) or decode(tokens, cache))
    out = generate(model, prompt(7), GREEDY, eos_id=-1, vocab_limit=VOCAB, seed=0)
    assert shapes == [(1, PREFILL_CHUNK)] + [(1, 1)] * (GREEDY.max_new_tokens - 1)
    monkeypatch.undo()
    assert out == generate(model, prompt(7), GREEDY, eos_id=-1, vocab_limit=VOCAB, seed=0, use_cache=False)


def test_decode_refuses_to_go_past_seq_len_and_a_cache_of_another_batch(tied_model):
    nearly_full = tied_model.empty_cache(1)
    nearly_full.length = SEQ - 1
    with pytest.raises(ValueError, match=f"2 new tokens after {SEQ - 1} cached positions exceed the cache's {SEQ} slots"):
        tied_model.decode(ms.Tensor(np.zeros((1, 2), np.int32)), nearly_full)
    with pytest.raises(ValueError, match="tokens hold 2 sequences but the KV cache was made for 1"):
        tied_model.decode(ms.Tensor(np.zeros((2, 1), np.int32)), tied_model.empty_cache(1))
    with pytest.raises(ValueError, match=r"padding \[0, 64\] must hold 2 slot counts in \[0, slots=64\)"):
        tied_model.empty_cache(2, [0, SEQ])


@pytest.mark.parametrize("config", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_cached_generation_equals_full_recomputation_token_for_token(model, config):
    ids = prompt(PREFILL_CHUNK + 5)  # one prefill chunk, then single tokens
    cached = generate(model, ids, config, eos_id=EOS, vocab_limit=VOCAB, seed=11, use_cache=True)
    recomputed = generate(model, ids, config, eos_id=EOS, vocab_limit=VOCAB, seed=11, use_cache=False)
    assert cached == recomputed
    assert len(cached.token_ids) == config.max_new_tokens and cached.stopped_by == "max_new_tokens"
    assert len(set(cached.token_ids)) > 3  # a varied continuation, not one token over and over


@pytest.mark.parametrize("config", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_batch_of_prompts_generates_what_each_prompt_generates_alone(model, config):
    prompts = [prompt(length, seed=length) for length in (3, 20, 9, 17)]
    stopping = GenerationConfig(**{**config.__dict__, "stop_token_ids": (prompts[1][-1],)})
    together = generate_batch(model, prompts, stopping, EOS, VOCAB, seed=4, prompt_indices=[5, 6, 7, 8])
    alone = [generate(model, ids, stopping, EOS, VOCAB, seed=4, prompt_index=5 + i) for i, ids in enumerate(prompts)]
    assert together == alone
    recomputed = generate_batch(model, prompts, stopping, EOS, VOCAB, seed=4, use_cache=False, prompt_indices=[5, 6, 7, 8])
    assert recomputed == alone


@pytest.mark.parametrize("config", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_generation_in_a_cache_sized_to_it_equals_recomputation(model, config, monkeypatch):
    """Slots in steps of 16: 3 or 20 prompt tokens and 12 new ones fit caches of 16 and 32 slots, below seq_len."""
    monkeypatch.setattr(generate_module, "CACHE_SLOT_STEP", 16)
    prompts = [prompt(3, seed=3), prompt(20, seed=20)]
    together = generate_batch(model, prompts, config, -1, VOCAB, seed=4)
    alone = [generate(model, ids, config, -1, VOCAB, seed=4, prompt_index=i) for i, ids in enumerate(prompts)]
    recomputed = generate_batch(model, prompts, config, -1, VOCAB, seed=4, use_cache=False)
    assert together == alone == recomputed
    assert [len(out.token_ids) for out in together] == [12, 12]


def test_rows_that_outlast_the_batch_columns_continue_to_their_own_context_limit(model):
    """Columns run out when the longest row reaches seq_len; the shorter row carries on in a batch of its own."""
    prompts = [prompt(SEQ - 4, seed=1), prompt(5, seed=2)]
    config = GenerationConfig(max_new_tokens=10)
    together = generate_batch(model, prompts, config, eos_id=-1, vocab_limit=VOCAB, seed=0)
    assert [(len(out.token_ids), out.stopped_by) for out in together] == [(4, "length"), (10, "max_new_tokens")]
    alone = [generate(model, ids, config, -1, VOCAB, seed=0, prompt_index=i) for i, ids in enumerate(prompts)]
    assert together == alone


# -------------------------------------------------------------------------------------------- seeds


def test_same_seed_same_generation_and_another_seed_another(model):
    ids = prompt(7)
    first = generate(model, ids, SAMPLED, eos_id=EOS, vocab_limit=VOCAB, seed=5)
    second = generate(model, ids, SAMPLED, eos_id=EOS, vocab_limit=VOCAB, seed=5)
    other = generate(model, ids, SAMPLED, eos_id=EOS, vocab_limit=VOCAB, seed=6)
    other_prompt_index = generate(model, ids, SAMPLED, eos_id=EOS, vocab_limit=VOCAB, seed=5, prompt_index=1)
    assert first == second
    assert other.token_ids != first.token_ids and other_prompt_index.token_ids != first.token_ids


def test_a_prompt_generates_the_same_whatever_ran_before_it(model):
    ids_a, ids_b = prompt(5, seed=1), prompt(9, seed=2)
    b_first = generate(model, ids_b, SAMPLED, EOS, VOCAB, seed=5, prompt_index=1)
    generate(model, ids_a, SAMPLED, EOS, VOCAB, seed=5, prompt_index=0)
    assert generate(model, ids_b, SAMPLED, EOS, VOCAB, seed=5, prompt_index=1) == b_first


SUBPROCESS_GENERATION = f"""
import json, sys
sys.path.insert(0, {str(TESTS_DIR)!r})
import test_eval
from model_core.eval import generate
out = generate(test_eval.generation_model(), test_eval.prompt(7), test_eval.SAMPLED, test_eval.EOS, test_eval.VOCAB, seed=5)
print(json.dumps(out.token_ids))
"""


def test_same_seed_same_generation_in_a_separate_process(model):
    here = generate(model, prompt(7), SAMPLED, eos_id=EOS, vocab_limit=VOCAB, seed=5)
    result = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_GENERATION], cwd=TESTS_DIR.parent, capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == here.token_ids


# ------------------------------------------------------------------------------------------ sampler


def test_top_k_keeps_exactly_the_k_largest_with_ties_to_lower_ids():
    logits = np.array([0.5, 2.0, 1.0, 2.0, -1.0, 1.0])
    assert top_k_mask(logits, 3).tolist() == [False, True, True, True, False, False]
    assert top_k_mask(logits, 0).all() and top_k_mask(logits, 10).all()


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    probabilities = np.array([0.05, 0.4, 0.25, 0.3])
    assert top_p_mask(probabilities, 0.6).tolist() == [False, True, False, True]  # 0.7 >= 0.6; 0.4 alone is not
    assert top_p_mask(probabilities, 0.7).tolist() == [False, True, False, True]  # exactly p is enough
    assert top_p_mask(probabilities, 0.01).tolist() == [False, True, False, False]  # at least one
    assert top_p_mask(probabilities, 1.0).all()
    random = np.random.default_rng(0).dirichlet(np.ones(100))
    for p in (0.3, 0.5, 0.9):
        kept = top_p_mask(random, p)
        assert random[kept].sum() >= p and random[kept].sum() - random[kept].min() < p


def test_sampled_tokens_stay_inside_top_k_and_top_p():
    logits = np.random.default_rng(1).standard_normal(50)
    rng = np.random.default_rng(2)
    top_k = GenerationConfig(max_new_tokens=1, temperature=1.0, top_k=5)
    draws = {choose_token(logits, [], top_k, 50, rng) for _ in range(400)}
    assert draws == set(np.argsort(-logits)[:5].tolist())
    nucleus = GenerationConfig(max_new_tokens=1, temperature=0.7, top_p=0.5)
    allowed = np.flatnonzero(sampling_probabilities(logits, nucleus))
    draws = {choose_token(logits, [], nucleus, 50, rng) for _ in range(400)}
    assert draws == set(allowed.tolist()) and 1 < len(allowed) < 50


@pytest.mark.parametrize("top_k", [0, 40])
def test_a_draw_is_the_inverse_cdf_of_the_whole_vocabulary_distribution_at_the_generators_uniform(top_k):
    """choose_token draws among top-k's ids only; it picks what the cumulative distribution over every id picks."""
    logits = np.random.default_rng(3).standard_normal(8000) * 3
    config = GenerationConfig(max_new_tokens=1, temperature=0.8, top_k=top_k, top_p=0.9)
    cumulative = np.cumsum(sampling_probabilities(logits, config))
    for seed in range(200):
        expected = np.searchsorted(cumulative, np.random.default_rng(seed).random() * cumulative[-1], side="right")
        assert choose_token(logits, [], config, 8000, np.random.default_rng(seed)) == expected


def test_temperature_zero_is_argmax_with_ties_to_the_lowest_id():
    logits = np.array([0.0, 3.0, -1.0, 3.0], np.float32)
    assert choose_token(logits, [], GREEDY, 4, np.random.default_rng(0)) == 1


def test_repetition_penalty_makes_seen_tokens_less_likely():
    logits = np.array([2.0, -2.0, 1.0, 0.5])
    penalized = penalize_repetition(logits, [0, 1, 1], 2.0)
    assert penalized.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied, unseen kept
    config = GenerationConfig(max_new_tokens=1, repetition_penalty=2.5)
    assert choose_token(logits, [0], config, 4, np.random.default_rng(0)) == 2


def test_padded_vocabulary_ids_are_never_chosen():
    logits = np.zeros(12)
    logits[10:] = 50.0  # ids the model has but the tokenizer does not
    rng = np.random.default_rng(0)
    assert choose_token(logits, [], GREEDY, 10, rng) < 10
    assert max(choose_token(logits, [], SAMPLED, 10, rng) for _ in range(300)) < 10
    with pytest.raises(ValueError, match="vocab_limit=13 is larger than the model's 12 logits"):
        choose_token(logits, [], GREEDY, 13, rng)


def test_generation_from_a_padded_vocabulary_model_stays_below_the_tokenizer_vocab(model):
    hot = GenerationConfig(max_new_tokens=20, temperature=5.0)  # nearly uniform over the whole vocabulary
    out = generate(model, [5, 17, 250, 99], hot, eos_id=EOS, vocab_limit=300, seed=0)
    assert max(out.token_ids) < 300 and len(out.token_ids) == 20


def test_eos_and_stop_tokens_end_generation_and_are_kept(model):
    ids = prompt(6)
    free = generate(model, ids, GREEDY, eos_id=-1, vocab_limit=VOCAB, seed=0).token_ids
    at_eos = generate(model, ids, GREEDY, eos_id=free[3], vocab_limit=VOCAB, seed=0)
    first_eos = free.index(free[3])
    assert at_eos.token_ids == free[: first_eos + 1] and at_eos.stopped_by == "eos"
    stop = GenerationConfig(max_new_tokens=12, stop_token_ids=(free[2],))
    at_stop = generate(model, ids, stop, eos_id=-1, vocab_limit=VOCAB, seed=0)
    assert at_stop.token_ids == free[: free.index(free[2]) + 1] and at_stop.stopped_by == "stop_token"


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_stops_when_the_context_reaches_seq_len(model, use_cache):
    out = generate(model, prompt(SEQ - 3), GREEDY, eos_id=-1, vocab_limit=VOCAB, seed=0, use_cache=use_cache)
    assert len(out.token_ids) == 3 and out.stopped_by == "length"
    full = generate(model, prompt(SEQ), GREEDY, eos_id=-1, vocab_limit=VOCAB, seed=0, use_cache=use_cache)
    assert full.token_ids == [] and full.stopped_by == "length"


def test_prompts_that_cannot_be_generated_from_are_rejected(model):
    with pytest.raises(ValueError, match="no tokens"):
        generate(model, [], GREEDY, EOS, VOCAB, seed=0)
    with pytest.raises(ValueError, match=f"the prompt has {SEQ + 1} tokens, more than model.seq_len={SEQ}"):
        generate(model, prompt(SEQ + 1), GREEDY, EOS, VOCAB, seed=0)
    with pytest.raises(ValueError, match=r"prompt ids \[400\] are outside the tokenizer's vocabulary of 300"):
        generate(model, [5, 400], GREEDY, EOS, 300, seed=0)


def test_config_from_eval_params():
    params = EvalParams(max_new_tokens=7, temperature=0.8, top_k=3, top_p=0.5, repetition_penalty=1.2, stop_token_ids=[4])
    assert GenerationConfig.from_params(params) == GenerationConfig(7, 0.8, 3, 0.5, 1.2, (4,))


# ------------------------------------------------------------------------------------- held-out loss


def packed(tokens: np.ndarray, doc_starts: list[list[int]]) -> PackedRows:
    offsets = np.concatenate([[0], np.cumsum([len(starts) for starts in doc_starts])]).astype(np.int64)
    values = np.array([start for starts in doc_starts for start in starts], dtype=np.int32)
    return PackedRows(tokens.astype(np.int32), values, offsets)


def test_perplexity_of_uniform_random_tokens_is_just_above_the_vocab_size(tied_model):
    # For labels drawn uniformly, the expected loss of ANY model is >= log V (Jensen: the mean of -log p over
    # all ids is at least -log of their mean, 1/V). A fresh model's logits are nearly equal (std 0.17 here),
    # so it sits a little above: ppl ~ V * exp(0.17^2 / 2) = 1.014 V, with ~0.5% noise from 1024 tokens.
    tokens = np.random.default_rng(0).integers(0, VOCAB, (16, SEQ + 1))
    result = held_out_loss(tied_model, packed(tokens, [[0]] * 16), 2, 8, pad_id=VOCAB, reset_at_documents=False)
    assert result.tokens == 16 * SEQ and result.batches == 8
    assert VOCAB <= result.perplexity <= 1.05 * VOCAB
    assert result.perplexity == pytest.approx(math.exp(result.mean_loss))


def test_held_out_loss_is_the_token_weighted_mean_of_a_hand_computation(tied_model):
    model, pad = tied_model, 0
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, VOCAB, (5, SEQ + 1))
    tokens[1, 40:] = pad  # a padded tail: its labels do not count
    starts = [[0, 20], [0], [0, 10, 50], [5], [0]]
    rows = packed(tokens, starts)
    result = held_out_loss(model, rows, batch_rows=2, max_batches=3, pad_id=pad, reset_at_documents=True)

    # By hand, in one forward over the 4 rows of the 2 full batches (the fifth row makes no full batch).
    pairs = [document_positions(row_starts, SEQ) for row_starts in starts[:4]]
    logits = model(
        ms.Tensor(tokens[:4, :-1].astype(np.int32)),
        ms.Tensor(np.stack([positions for positions, _ in pairs])),
        ms.Tensor(np.stack([segments for _, segments in pairs])),
    ).asnumpy().astype(np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    labels = tokens[:4, 1:]
    losses = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0][labels != pad]
    assert result.batches == 2 and result.tokens == len(losses) == 4 * SEQ - 25  # row 1's labels 39.. are padding
    assert result.mean_loss == pytest.approx(losses.mean(), rel=1e-5)


def test_held_out_loss_without_a_full_batch_says_so(tied_model):
    rows = packed(np.ones((3, SEQ + 1)), [[0]] * 3)
    with pytest.raises(ValueError, match=r"no counted tokens in 0 held-out batches of 4 rows \(the split has 3 rows\)"):
        held_out_loss(tied_model, rows, 4, 2, pad_id=0, reset_at_documents=False)


# ------------------------------------------------------------------------------------------- report


def test_report_is_written_as_json_and_markdown(tmp_path):
    report = EvalReport(
        checkpoint="runs/tiny/step-00000300",
        adapters=["runs/lora/adapter-1"],
        decoding=SAMPLED,
        seed=5,
        held_out={"validation": HeldOutLoss(2.5, math.exp(2.5), 1000, 4)},
        generations=[PromptOutput("def add(a, b):\n", [1, 9, 8], [7, 2], "```x``` ok", "eos")],
    )
    json_path, markdown_path = write_report(report, tmp_path / "eval")
    data = json.loads(json_path.read_text())
    assert data["decoding"]["top_k"] == 40 and data["seed"] == 5
    assert data["held_out"]["validation"] == {"mean_loss": 2.5, "perplexity": math.exp(2.5), "tokens": 1000, "batches": 4}
    assert data["generations"][0]["stopped_by"] == "eos" and data["generations"][0]["text"] == "```x``` ok"
    markdown = markdown_path.read_text()
    assert "| validation | 2.5000 | 12.18 | 1000 | 4 |" in markdown
    assert "````text\n```x``` ok\n````" in markdown  # a fence longer than the backticks inside
    assert "def add(a, b):\n" in markdown and "stopped by eos" in markdown
    assert sorted(path.name for path in (tmp_path / "eval").iterdir()) == ["eval_report.json", "eval_report.md"]


# -------------------------------------------------------------------------------- whole evaluation


@pytest.fixture(scope="module")
def prepared(corpus_jsonl, tmp_path_factory):
    """(params, dataset dir, checkpoint dir, the model whose weights the checkpoint holds)."""
    root = tmp_path_factory.mktemp("eval")
    params = load_params("tiny", [
        f"data.sources=[{{kind: jsonl, paths: ['{corpus_jsonl}']}}]", f"data.output_dir={root / 'data'}", *SMALL_MODEL,
        "train.micro_batch_size=2", "eval.batches=2", "eval.max_new_tokens=6", "eval.temperature=0.8",
        "eval.prompts=['Return the number of', 'Split the string at']",
    ])
    dataset = prepare_dataset(params.data, params.tokenizer, params.model)
    model = Llama(params.model)
    (root / "checkpoint").mkdir()
    write_safetensors(root / "checkpoint" / "model.safetensors", model_weights(model), "float32")
    return params, dataset, root / "checkpoint", model


def test_load_model_holds_the_checkpoint_weights_and_the_adapters(prepared, tmp_path):
    params, _, checkpoint, model = prepared
    saved = model_weights(model)
    loaded = model_weights(load_model(checkpoint, model=params.model))
    assert loaded.keys() == saved.keys() and all(np.array_equal(loaded[k], saved[k]) for k in saved)
    tuned = load_model(checkpoint, model=params.model)
    apply_lora(tuned, params.lora)
    for layer in lora_layers(tuned).values():
        ops.assign(layer.lora_b, ms.Tensor(np.full(layer.lora_b.shape, 0.05, np.float32)))
    save_adapters(tmp_path / "adapters", tuned, params.lora, base_sha256(checkpoint))
    reloaded, expected = model_weights(load_model(checkpoint, tmp_path / "adapters", params.model)), model_weights(tuned)
    assert reloaded.keys() == expected.keys() and all(np.array_equal(reloaded[k], expected[k]) for k in expected)


def test_model_core_load_model_reads_the_architecture_from_the_checkpoint(prepared, tmp_path):
    import model_core

    params, _, checkpoint, model = prepared
    recorded = tmp_path / "recorded"
    shutil.copytree(checkpoint, recorded)
    (recorded / "params.json").write_text(params.model.model_dump_json())
    tokens = ms.Tensor(np.arange(12, dtype=np.int32).reshape(2, 6) % params.model.vocab_size)
    loaded = model_core.load_model(recorded)
    model.set_train(False)
    assert np.array_equal(loaded(tokens).asnumpy(), model(tokens).asnumpy())
    other = params.model.model_copy(update={"num_layers": params.model.num_layers + 1})
    with pytest.raises(ValueError, match=f"model.num_layers={params.model.num_layers}, not {other.num_layers}"):
        model_core.load_model(recorded, model=other)
    with pytest.raises(FileNotFoundError, match="records no model"):
        model_core.load_model(checkpoint)


def test_evaluate_model_scores_held_out_sets_and_generates_from_every_prompt(prepared):
    params, dataset, _, model = prepared
    report = evaluate_model(model, params, dataset.tokenizer_path, {"pretraining": dataset.output_dir}, "ckpt", [])
    rows = open_split(dataset.output_dir, "validation")
    direct = held_out_loss(model, rows, 2, 2, params.tokenizer.pad_id, params.train.reset_at_document_boundaries)
    assert report.held_out == {"pretraining": direct} and report.seed == params.eval.seed
    assert [output.prompt for output in report.generations] == params.eval.prompts
    config = GenerationConfig.from_params(params.eval)
    tokenizer = spm.SentencePieceProcessor(model_file=str(dataset.tokenizer_path))
    for index, output in enumerate(report.generations):
        assert output.prompt_ids == [params.tokenizer.bos_id, *tokenizer.encode(output.prompt)]
        again = generate(model, output.prompt_ids, config, params.tokenizer.eos_id, 512, params.eval.seed, prompt_index=index)
        assert (output.token_ids, output.stopped_by) == (again.token_ids, again.stopped_by)
        assert output.text == tokenizer.decode(output.token_ids)


def test_evaluate_checkpoint_refuses_a_prompt_longer_than_the_context(prepared):
    params, dataset, checkpoint, _ = prepared
    long_prompt = params.model_copy(update={"eval": params.eval.model_copy(update={"prompts": ["ok", "word " * 40]})})
    with pytest.raises(ValueError, match=r"eval.prompts\[1\] is \d+ tokens long, more than model.seq_len=32"):
        evaluate_checkpoint(long_prompt, checkpoint, dataset.tokenizer_path, {"pretraining": dataset.output_dir})
