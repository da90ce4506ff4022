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

from model_core.model.llama import Llama
from params.schema import EvalParams

StopReason = Literal["eos", "stop_token", "max_new_tokens", "length"]

# Prompts enter the KV cache in chunks of this many tokens, the rest one at a time: two compiled graphs
# serve every prompt length (a graph per prompt length costs seconds of compiling each).
PREFILL_CHUNK = 16


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
    keep = np.zeros(len(logits), dtype=bool)
    keep[np.argsort(-logits, kind="stable")[:k]] = True
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
    scaled = logits / config.temperature
    scaled = np.where(top_k_mask(scaled, config.top_k), scaled, -np.inf)
    probabilities = np.exp(scaled - scaled.max())
    probabilities /= probabilities.sum()
    probabilities = np.where(top_p_mask(probabilities, config.top_p), probabilities, 0.0)
    return probabilities / probabilities.sum()


def choose_token(
    logits: np.ndarray, seen: Sequence[int], config: GenerationConfig, vocab_limit: int, rng: np.random.Generator
) -> int:
    """The next id, < vocab_limit, from one position's logits [model vocab] and the ids so far."""
    if vocab_limit > len(logits):
        raise ValueError(f"vocab_limit={vocab_limit} is larger than the model's {len(logits)} logits")
    scores = penalize_repetition(logits[:vocab_limit].astype(np.float64), seen, config.repetition_penalty)
    if config.temperature == 0.0:
        return int(np.argmax(scores))  # the first maximum: ties go to the lowest id
    cumulative = np.cumsum(sampling_probabilities(scores, config))
    # side="right" never lands on an id of probability 0: its cumulative mass equals its predecessor's.
    return int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))


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
    _check_prompt(prompt_ids, vocab_limit, model.seq_len)
    rng = np.random.default_rng([seed, prompt_index])
    last_logits = _cached_last_logits(model) if use_cache else _recomputed_last_logits(model)
    context, new = [int(token) for token in prompt_ids], []
    while True:
        if len(new) == config.max_new_tokens:
            return Generation(new, "max_new_tokens")
        if len(context) >= model.seq_len:
            return Generation(new, "length")
        token = choose_token(last_logits(context), context, config, vocab_limit, rng)
        context.append(token)
        new.append(token)
        if token == eos_id:
            return Generation(new, "eos")
        if token in config.stop_token_ids:
            return Generation(new, "stop_token")


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


def _cached_last_logits(model: Llama) -> Callable[[list[int]], np.ndarray]:
    """Logits of the context's last position; the cache is fed only the tokens it has not seen yet."""
    cache = model.empty_cache(1)

    def last_logits(context: list[int]) -> np.ndarray:
        nonlocal cache
        unseen = context[cache.length :]
        while unseen:
            step = PREFILL_CHUNK if len(unseen) >= PREFILL_CHUNK else 1
            logits, cache = model.decode(ms.Tensor([unseen[:step]], ms.int32), cache)
            unseen = unseen[step:]
        return logits.asnumpy()[0, -1]

    return last_logits
