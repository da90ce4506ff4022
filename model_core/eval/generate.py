"""Text generation from a Llama with the decoding rules of `EvalParams`, with or without the KV cache.

Sampling runs on the host in numpy float64 from the model's fp32 logits of the last position, always in
this order: ids the tokenizer does not have are dropped (the model's vocabulary may be padded), the
repetition penalty, then greedy argmax (temperature 0) or temperature, top-k, top-p and one draw. Each
prompt draws from its own generator seeded by (seed, prompt index), so its output does not depend on
which other prompts run, or in what order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import mindspore as ms
import numpy as np

from model_core.model.llama import KVCache, Llama
from params.schema import EvalParams

StopReason = Literal["eos", "stop_token", "max_new_tokens", "length"]

# Prompts enter the KV cache in chunks of this many tokens: two compiled graphs (a chunk, and the one token of a
# decoding step) serve every prompt length, where a graph per prompt length costs seconds of compiling each.
# Prompts are left-padded to whole chunks where the cache has room (`prefill_padding`); where it has not, the
# tokens after the last whole chunk go in one step each.
PREFILL_CHUNK = 16
# A KV cache holds the generation (longest prompt + max_new_tokens) rounded up to a multiple of this many slots,
# at most model.seq_len: attention reads every slot at every step, and a few cache sizes (so a few compiled
# graphs) serve every generation length.
CACHE_SLOT_STEP = 64


@dataclass(frozen=True)
class GenerationConfig:
    """How tokens are chosen; see the module docstring for the order the rules apply in."""

    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: keep all
    top_p: float = 1.0  # 1: keep all
    repetition_penalty: float = 1.0  # 1: off
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_params(cls, params: EvalParams) -> GenerationConfig:
        return cls(
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            repetition_penalty=params.repetition_penalty,
            stop_token_ids=tuple(params.stop_token_ids),
        )


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # the new tokens, a final EOS or stop token included
    stopped_by: StopReason


# ------------------------------------------------------------------------------------------ sampling


def penalize_repetition(logits: np.ndarray, seen: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style: the logit of every seen id moves towards "less likely" (positive / penalty, negative * penalty)."""
    if penalty == 1.0 or len(seen) == 0:
        return logits
    ids = np.unique(np.asarray(seen, dtype=np.int64))
    penalized = logits.copy()
    picked = penalized[ids]
    penalized[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return penalized


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """bool mask of the k largest logits (ties: lower ids first); all True when k is 0 or >= len(logits)."""
    if k == 0 or k >= len(logits):
        return np.ones(len(logits), dtype=bool)
    # A partition, not a sort: this runs for every row at every step, and sorting the vocabulary costs ~6x more.
    kth_largest = np.partition(logits, len(logits) - k)[len(logits) - k]
    keep = logits > kth_largest
    keep[np.flatnonzero(logits == kth_largest)[: k - int(keep.sum())]] = True
    return keep


def top_p_mask(probabilities: np.ndarray, p: float) -> np.ndarray:
    """bool mask of the smallest set of most likely ids whose mass is >= p (never empty); all True at p = 1."""
    if p >= 1.0:
        return np.ones(len(probabilities), dtype=bool)
    order = np.argsort(-probabilities, kind="stable")
    mass = np.cumsum(probabilities[order])
    keep = np.zeros(len(probabilities), dtype=bool)
    keep[order[: int(np.searchsorted(mass, p * mass[-1])) + 1]] = True
    return keep


def sampling_probabilities(logits: np.ndarray, config: GenerationConfig) -> np.ndarray:
    """float64 probabilities after temperature, top-k and top-p (config.temperature must be > 0)."""
    ids, kept = _candidates(logits, config)
    probabilities = np.zeros(len(logits))
    probabilities[ids] = kept
    return probabilities


def _candidates(logits: np.ndarray, config: GenerationConfig) -> tuple[np.ndarray, np.ndarray]:
    """The ids top-k keeps (all of them without top-k), ascending, and their `sampling_probabilities`. The work
    after top-k runs on its k ids only, not over the whole vocabulary, for every row at every step."""
    scaled = logits / config.temperature
    ids = np.flatnonzero(top_k_mask(scaled, config.top_k))
    kept = scaled[ids]
    probabilities = np.exp(kept - kept.max())
    probabilities /= probabilities.sum()
    probabilities = np.where(top_p_mask(probabilities, config.top_p), probabilities, 0.0)
    return ids, probabilities / probabilities.sum()


def choose_token(
    logits: np.ndarray, seen: Sequence[int], config: GenerationConfig, vocab_limit: int, rng: np.random.Generator
) -> int:
    """The next id, < vocab_limit, from one position's logits [model vocab] and the ids so far."""
    if vocab_limit > len(logits):
        raise ValueError(f"vocab_limit={vocab_limit} is larger than the model's {len(logits)} logits")
    scores = penalize_repetition(logits[:vocab_limit].astype(np.float64), seen, config.repetition_penalty)
    if config.temperature == 0.0:
        return int(np.argmax(scores))  # the first maximum: ties go to the lowest id
    ids, probabilities = _candidates(scores, config)
    cumulative = np.cumsum(probabilities)
    # side="right" never lands on an id of probability 0: its cumulative mass equals its predecessor's.
    return int(ids[np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")])


# ------------------------------------------------------------------------------------------ decoding


def generate(
    model: Llama,
    prompt_ids: Sequence[int],
    config: GenerationConfig,
    eos_id: int,
    vocab_limit: int,
    seed: int,
    use_cache: bool = True,
    prompt_index: int = 0,
) -> Generation:
    """New tokens after `prompt_ids`, until EOS, a stop token, config.max_new_tokens, or a context of
    model.seq_len tokens. `use_cache=False` runs the whole context through the training forward for
    every token (the reference the cached path must match). Draws come from default_rng([seed, prompt_index]).
    """
    return generate_batch(model, [prompt_ids], config, eos_id, vocab_limit, seed, use_cache, [prompt_index])[0]


def generate_batch(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    eos_id: int,
    vocab_limit: int,
    seed: int,
    use_cache: bool = True,
    prompt_indices: Sequence[int] | None = None,
) -> list[Generation]:
    """`generate` for several prompts; each output equals that prompt's `generate` alone (prompt_indices[i],
    default i, seeds its draws). With the cache, the prompts decode together as one batch: shorter prompts are
    left-padded, and each row keeps its own positions and sees only its own slots (see `KVCache`)."""
    prompt_indices = range(len(prompts)) if prompt_indices is None else prompt_indices
    if len(prompt_indices) != len(prompts):
        raise ValueError(f"{len(prompt_indices)} prompt indices for {len(prompts)} prompts")
    for prompt_ids in prompts:
        _check_prompt(prompt_ids, vocab_limit, model.seq_len)
    rows = [_Row(ids, np.random.default_rng([seed, index])) for ids, index in zip(prompts, prompt_indices)]
    if use_cache:
        # A session ends when its columns reach seq_len; its longest row then stops at "length", the others go on.
        while active := _settle(rows, config, model.seq_len):
            _decode_together(model, active, config, eos_id, vocab_limit)
    else:
        for row in rows:
            last_logits = _recomputed_last_logits(model)
            while _settle([row], config, model.seq_len):
                row.choose(last_logits(row.context), config, eos_id, vocab_limit)
    return [Generation(row.new, row.stopped_by) for row in rows]


class _Row:
    """One prompt's decoding state: its context so far, the new tokens, its generator, and why it stopped."""

    def __init__(self, prompt_ids: Sequence[int], rng: np.random.Generator):
        self.context = [int(token) for token in prompt_ids]
        self.new: list[int] = []
        self.rng = rng
        self.stopped_by: StopReason | None = None

    def choose(self, logits: np.ndarray, config: GenerationConfig, eos_id: int, vocab_limit: int) -> None:
        token = choose_token(logits, self.context, config, vocab_limit, self.rng)
        self.context.append(token)
        self.new.append(token)
        if token == eos_id:
            self.stopped_by = "eos"
        elif token in config.stop_token_ids:
            self.stopped_by = "stop_token"


def _settle(rows: list[_Row], config: GenerationConfig, seq_len: int) -> list[_Row]:
    """The rows still generating, after stopping those that reached max_new_tokens or a full context."""
    for row in rows:
        if row.stopped_by is None and len(row.new) == config.max_new_tokens:
            row.stopped_by = "max_new_tokens"
        elif row.stopped_by is None and len(row.context) >= seq_len:
            row.stopped_by = "length"
    return [row for row in rows if row.stopped_by is None]


def _decode_together(model: Llama, rows: list[_Row], config: GenerationConfig, eos_id: int, vocab_limit: int) -> None:
    """Extend `rows` as one batch through the KV cache until all stop or the cache's columns run out.

    Rows that stop early keep a slot in the batch (fed their last token, their logits ignored): the batch keeps
    its shape, so no decode step compiles again.
    """
    width = max(len(row.context) for row in rows)
    width += prefill_padding(width, config.max_new_tokens, model.seq_len)
    padding = [width - len(row.context) for row in rows]
    columns = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        columns[i, padding[i] :] = row.context
    cache = model.empty_cache(len(rows), padding, cache_slots(width, config.max_new_tokens, model.seq_len))
    logits = _prefill(model, columns, cache)
    while True:
        for i, row in enumerate(rows):
            if row.stopped_by is None:
                row.choose(logits[i], config, eos_id, vocab_limit)
        if not _settle(rows, config, model.seq_len) or cache.length == cache.slots:
            return
        last = np.array([[row.context[-1]] for row in rows], np.int32)
        logits = model.decode(ms.Tensor(last), cache).asnumpy()[:, -1]


def cache_slots(prompt_width: int, max_new_tokens: int, seq_len: int) -> int:
    """Slots of the KV cache for prompts up to `prompt_width` tokens and max_new_tokens more (see CACHE_SLOT_STEP)."""
    needed = prompt_width + max_new_tokens
    return min(seq_len, -(-needed // CACHE_SLOT_STEP) * CACHE_SLOT_STEP)


def prefill_padding(prompt_width: int, max_new_tokens: int, seq_len: int) -> int:
    """Columns of left-padding that make prompts `prompt_width` wide a whole number of PREFILL_CHUNKs, or 0 where the
    cache the generation takes (`cache_slots`) has no room for them: padding never cuts a generation short."""
    extra = -prompt_width % PREFILL_CHUNK
    fits = prompt_width + extra + max_new_tokens <= cache_slots(prompt_width, max_new_tokens, seq_len)
    return extra if fits else 0


def _prefill(model: Llama, columns: np.ndarray, cache: KVCache) -> np.ndarray:
    """Feed columns [B, T] into an empty cache; the logits [B, vocab] of the last column."""
    start = 0
    while start < columns.shape[1]:
        step = PREFILL_CHUNK if columns.shape[1] - start >= PREFILL_CHUNK else 1
        logits = model.decode(ms.Tensor(columns[:, start : start + step]), cache)
        start += step
    return logits.asnumpy()[:, -1]


def _check_prompt(prompt_ids: Sequence[int], vocab_limit: int, seq_len: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("the prompt has no tokens; encode at least a BOS token")
    if len(prompt_ids) > seq_len:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than model.seq_len={seq_len}")
    bad = [int(token) for token in prompt_ids if not 0 <= token < vocab_limit]
    if bad:
        raise ValueError(f"prompt ids {bad[:5]} are outside the tokenizer's vocabulary of {vocab_limit}")


def _recomputed_last_logits(model: Llama) -> Callable[[list[int]], np.ndarray]:
    """Logits of the context's last position from the training forward over the whole context.

    The context is padded to model.seq_len so that one compiled graph serves every length; causal attention
    keeps the padding out of every earlier position's logits.
    """

    def last_logits(context: list[int]) -> np.ndarray:
        padded = np.zeros((1, model.seq_len), np.int32)
        padded[0, : len(context)] = context
        return model.compiled_forward(ms.Tensor(padded)).asnumpy()[0, len(context) - 1]

    return last_logits
